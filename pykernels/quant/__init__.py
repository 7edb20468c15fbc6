"""Quantized GEMMs: bipolar-INT bit-serial and Marlin-style W4 (issue #5). Not implemented yet."""


def _todo(*args, **kwargs):
    raise NotImplementedError("pykernels.qmatmul: not implemented yet (issue #5)")


quantize = qmatmul = quantize_model = _todo


class QuantizedWeight:
    def __init__(self, *args, **kwargs):
        _todo()


class QuantLinear:
    def __init__(self, *args, **kwargs):
        _todo()

"""Onesweep-style LSD radix sort (issue #3). Not implemented yet."""


def _todo(*args, **kwargs):
    raise NotImplementedError("pykernels.sort: not implemented yet (issue #3)")


sort = argsort = sort_keys = sort_pairs = segmented_sort = _todo

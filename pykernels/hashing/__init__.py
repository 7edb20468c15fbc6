"""WarpCore-style hash tables (issue #4). Not implemented yet."""


class _Todo:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"pykernels.{type(self).__name__}: not implemented yet (issue #4)")


class HashMap(_Todo): pass
class HashSet(_Todo): pass
class CountingTable(_Todo): pass
class MultiValueHashMap(_Todo): pass
class BloomFilter(_Todo): pass

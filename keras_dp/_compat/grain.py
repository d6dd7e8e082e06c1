"""Grain's private hooks: its loaders' and iterators' inner state."""


def grain_inner_iterator(iterator):
    """The dataset iterator a `grain.DataLoader`'s iterator wraps (`_iterator`), or None.

    A `DataLoader`'s iterator has no `close`; the iterator it wraps does,
    and closing it stops Grain's prefetch threads and worker processes.
    """
    return getattr(iterator, "_iterator", None)


def grain_loader_epochs(loader):
    """`num_epochs` of a `grain.DataLoader`'s sampler (`_sampler._num_epochs`): None is endless.

    1 where the loader has no such sampler.
    """
    return getattr(getattr(loader, "_sampler", None), "_num_epochs", 1)


def grain_repeat_epochs(dataset):
    """`num_epochs` of a Grain `RepeatIterDataset` (`_num_epochs`): None repeats forever."""
    return getattr(dataset, "_num_epochs", 1)


def grain_elastic(dataset):
    """Whether `dataset` is a `grain.experimental.ElasticIterator` (its position is global)."""
    import grain

    elastic = getattr(grain.experimental, "ElasticIterator", None)
    return elastic is not None and isinstance(dataset, elastic)


def grain_elastic_pass(dataset):
    """A fresh pass over an `ElasticIterator`: a new one on its dataset (`_ds` and its options).

    `iter()` of an `ElasticIterator` returns the same iterator every time,
    so its second pass would be empty; keras_dp reads one pass per epoch.
    """
    fresh = type(dataset)(dataset._ds, dataset._global_batch_size, dataset._shard_options,
                          read_options=dataset._read_options,
                          multiprocessing_options=dataset._multiprocessing_options)
    return iter(fresh)


def grain_elastic_batch_size(dataset):
    """The global batch size of an `ElasticIterator` (`_global_batch_size`)."""
    return int(dataset._global_batch_size)


def grain_elastic_dataset(dataset):
    """The `MapDataset` an `ElasticIterator` reads (`_ds`)."""
    return dataset._ds

"""Each process's share of a dataset: `shard_for_processes`."""

import jax


def shard_for_processes(dataset):
    """This process's share of `dataset`: every `P`-th element, from the `index`-th.

    Across `P` JAX processes (`jax.process_count()`), process `index`
    (`jax.process_index()`) keeps elements `index, index + P, ...`, so the
    processes read disjoint shares that together are the whole dataset. In
    one process the dataset is returned as it is. keras_dp reads a dataset
    as this process's input as given; apply this (or shard it yourself)
    before batching, so that each batch is a local batch.

    Args:
        dataset: a `tf.data.Dataset` (sharded with
            `dataset.shard(P, index)`) or a `grain.MapDataset` (sliced
            `dataset[index::P]`, Grain's own sharding of a map dataset).

    Returns:
        A dataset of the same kind.

    Raises:
        TypeError: any other input, with how to shard it instead (a
            `grain.DataLoader` is sharded by its sampler's `shard_options`,
            a `grain.IterDataset` through the `MapDataset` it came from).
    """
    count, index = jax.process_count(), jax.process_index()
    kind = type(dataset).__module__.split(".")[0]
    if kind == "tensorflow" and hasattr(dataset, "shard"):
        return dataset if count == 1 else dataset.shard(count, index)
    if kind == "grain":
        import grain

        if isinstance(dataset, grain.MapDataset):
            return dataset if count == 1 else dataset[index::count]
        raise TypeError(
            f"A {type(dataset).__name__} cannot be sliced by process. Shard a "
            "grain.DataLoader through its sampler, IndexSampler(..., shard_options="
            "grain.sharding.ShardByJaxProcess(drop_remainder=True)), and an "
            "IterDataset before it was made: shard_for_processes(map_dataset)"
            ".to_iter_dataset().") from None
    raise TypeError(
        "shard_for_processes takes a tf.data.Dataset or a grain.MapDataset. "
        f"Received: {type(dataset).__name__}. For arrays, pass fit each "
        "process's own rows: x, y = keras_dp.distributed.process_share(x, y) "
        "(see the docs: guides/many-hosts).")

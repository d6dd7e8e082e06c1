"""Device-resident data (`keras_dp.core.feed`): bitwise the host path, and its refusals."""

import warnings

import numpy as np
import pytest

import keras_dp
from keras_dp import sharding as placement
from keras_dp.core import feed as resident
from keras_dp.multihost import hosts as hosts_lib
from conftest import devices, mlp, weights


def count_host_batches(monkeypatch):
    """Count the host batches `placement` puts on the devices."""
    placed = []
    for name in ("to_device", "to_device_stacked"):
        original = getattr(placement, name)

        def counted(*args, _original=original, **kwargs):
            placed.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(placement, name, counted)
    return placed


# K=1 behind --runslow (8 s): K=4 runs the same gather plus its K-step
# program, and array fits elsewhere in CI take the resident path by default.
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_resident_training_equals_host_fed_training_bitwise(mnist, monkeypatch, k):
    # 230 shuffled rows at batch 32 on 3 devices: 7 full batches and a
    # partial one of 6 (with K=4: a call of 4, then 3 and the partial batch
    # alone), Dropout's seed state, class weights, two epochs.
    (x, y), _ = mnist
    placed = count_host_batches(monkeypatch)
    results = {}
    for on_device in (False, True):
        model = mlp(seed=5, dropout=0.5)
        trainer = keras_dp.ShardedTrainer(model, devices=devices(3), steps_per_execution=k,
                                          data_on_device=on_device)
        placed.clear()
        history = trainer.fit(x[:230], y[:230], batch_size=32, epochs=2, verbose=0,
                              class_weight={0: 2.0, 3: 0.5})
        results[on_device] = (history.history, weights(model), len(placed))
    assert results[True][2] == 0 and results[False][2] > 0  # no batch copied from the host
    assert results[True][0] == results[False][0]
    for host, on_device in zip(results[False][1], results[True][1], strict=True):
        np.testing.assert_array_equal(host, on_device)


def test_auto_is_resident_when_the_data_fits_and_warns_when_it_does_not(mnist, monkeypatch):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    assert trainer.data_on_device == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(x[:128], y[:128], batch_size=64, verbose=0)
    assert trainer.programs.resident_step._cache_size() == 1
    monkeypatch.setattr(resident, "CPU_CAP_BYTES", 1000)
    placed = count_host_batches(monkeypatch)
    with pytest.warns(UserWarning, match="exceed the 1,000 bytes.*from the host instead"):
        trainer.fit(x[:128], y[:128], batch_size=64, verbose=0)
    assert len(placed) == 2
    # Datasets take the host path under "auto", without a word.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit([(x[:64], y[:64])], verbose=0)


def test_data_on_device_true_refuses_what_it_cannot_keep(mnist, monkeypatch):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), data_on_device=True)
    with pytest.raises(ValueError, match="dataset or iterable.*pass numpy arrays"):
        trainer.fit([(x[:64], y[:64])], verbose=0)
    with pytest.raises(ValueError, match="`steps_per_epoch`.*leave it unset"):
        trainer.fit(x[:128], y[:128], batch_size=64, steps_per_epoch=3, verbose=0)
    monkeypatch.setattr(resident, "CPU_CAP_BYTES", 1000)
    with pytest.raises(ValueError, match="exceed.*Pass data_on_device='auto'.*or False"):
        trainer.fit(x[:128], y[:128], batch_size=64, verbose=0)
    with pytest.raises(ValueError, match="'auto' \\(the default, also None\\), True or False"):
        keras_dp.ShardedTrainer(mlp(), devices=devices(2), data_on_device="yes")
    monkeypatch.setattr(hosts_lib.OneProcess, "whole_data", False)
    with pytest.raises(ValueError, match="spans processes.*Pass data_on_device='auto' or False"):
        keras_dp.ShardedTrainer(mlp(), devices=devices(2), data_on_device=True)


def test_float64_data_is_sized_as_the_float32_the_devices_hold(mnist, monkeypatch):
    # Without jax_enable_x64, float64 and int64 arrays go on the devices as
    # float32 and int32; "auto" sized them at their host bytes, twice what
    # the devices hold, and fed a float64 frame that fits from the host.
    (x, y), _ = mnist
    x, y = x[:128].astype("float64") / 255, y[:128].astype("int64")
    assert resident.data_bytes((x, y)) == (x.size + y.size) * 4
    monkeypatch.setattr(resident, "CPU_CAP_BYTES", 2 * (x.size + y.size) * 4)
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    placed = count_host_batches(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(x, y, batch_size=64, verbose=0)
    assert not placed


def test_fits_compares_against_the_devices_memory_where_reported():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    class Mesh:
        devices = np.asarray([Device({"bytes_limit": 1000, "bytes_in_use": 200}),
                              Device({"bytes_limit": 1000, "bytes_in_use": 0})])

    assert resident.fits(400, Mesh())[0]
    fit, why = resident.fits(401, Mesh())
    assert not fit and "401 bytes of data exceed 400, 50% of the 800 bytes free" in why
    # With the train step's peak known (a fit's MemoryPlan on accelerators),
    # the data and that peak together take at most 90% of what is free.
    assert resident.fits(400, Mesh(), peak=320) == (True, None)
    fit, why = resident.fits(400, Mesh(), peak=321)
    assert not fit and ("400 bytes of data and the train step's peak of 321 bytes exceed "
                        "720, 90% of the 800 bytes free on a device") in why
    Mesh.devices = np.asarray([Device(None), Device(None)])
    assert resident.fits(resident.CPU_CAP_BYTES // 2, Mesh())[0]
    assert not resident.fits(resident.CPU_CAP_BYTES // 2 + 1, Mesh())[0]

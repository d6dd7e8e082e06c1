"""The processes' plan of rows, in one process: what each step places, and when.

The multi-process runs themselves are in `tests/test_distributed.py`; here
the plan is driven by a stand-in for the exchange, so that its rules are
checked in milliseconds.
"""

import numpy as np

from keras_dp.multihost import channel as exchange
from keras_dp.multihost import batches as global_batches
from keras_dp import sources as pipeline


class FakeChannel:
    """Answers each round with this process's values and the others' given ones."""

    def __init__(self, others):
        self.others, self.sent = list(others), []

    def all_gather(self, values):
        self.sent.append(list(values))
        return [list(values), self.others.pop(0)]  # this test process is process 0


def plan(rows, others, batches, steps_per_execution=4):
    place = object.__new__(global_batches.GlobalBatches)
    place.order = [0, 1]
    channel = FakeChannel(others)
    steps = list(place._plan(channel, iter(batches), steps_per_execution, rows))
    return [(blocks, None if batch is None else len(batch)) for blocks, batch in steps], channel


def test_array_epochs_are_planned_in_one_round_and_padded_where_a_share_ends():
    arrays = pipeline.make_batches(np.zeros((10, 1)), np.zeros(10), batch_size=4)
    assert arrays.planned_rows() == [4, 4, 2]
    assert arrays.planned_rows(skip=1) == [4, 2]
    batches = [np.zeros(4), np.zeros(4), np.zeros(2)]
    steps, channel = plan([4, 4, 2], [[4, 4, 4, 1]], batches)
    assert channel.sent == [[4, 4, 2]]  # one round for the epoch
    assert steps == [((4, 4), 4), ((4, 4), 4), ((2, 4), 2), ((0, 1), None)]


def test_dataset_counts_go_a_chunk_at_a_time_until_every_process_is_out():
    assert pipeline.make_batches([(np.zeros((2, 1)),)]).planned_rows() is None
    assert [global_batches.chunk_steps(k) for k in (1, 3, 4, 16)] == [8, 9, 8, 16]
    batches = [np.zeros(3)] * 10
    steps, channel = plan(None, [[3] * 8, [3, 3], []], batches)
    assert channel.sent == [[3] * 8, [3, 3], []]  # 3 rounds for 10 steps
    assert steps == [((3, 3), 3)] * 10


def test_a_process_out_of_data_sends_padding_while_another_has_rows():
    steps, channel = plan(None, [[5] * 8, [5] * 3, []], [np.zeros(5)] * 2)
    assert channel.sent == [[5, 5], [], []]
    assert steps == [((5, 5), 5)] * 2 + [((0, 5), None)] * 9


def test_counts_travel_as_run_lengths():
    values = [64] * 900 + [30]
    text = exchange._encode(values)
    assert text == "64*900,30*1" and exchange._decode(text) == values
    assert exchange._decode(exchange._encode([])) == []

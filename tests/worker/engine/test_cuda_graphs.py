import torch

from worker.engine.cuda_graphs import DecodeGraphs, bucket_sizes


def _buffers():
    return {"slot_mapping": torch.zeros(16, dtype=torch.int64),
            "block_tables": torch.zeros(16, 4, dtype=torch.int32)}


def test_buckets_cover_every_batch_size_up_to_the_max():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(1) == [1]


def test_off_on_cpu_runs_the_step_eagerly_on_the_live_inputs():
    seen = []

    def step(inputs):
        seen.append(inputs)
        return inputs["slot_mapping"] * 2

    graphs = DecodeGraphs(step, _buffers(), pad={"slot_mapping": -1})
    graphs.capture()
    assert not graphs.enabled and not graphs.graphs
    live = {"slot_mapping": torch.tensor([5, 9, 3]), "block_tables": torch.ones(3, 2, dtype=torch.int32)}
    assert torch.equal(graphs.run(live), torch.tensor([10, 18, 6]))
    assert seen[0]["slot_mapping"] is live["slot_mapping"]


def test_staging_copies_live_rows_and_pads_up_to_the_bucket():
    graphs = DecodeGraphs(lambda x: x["slot_mapping"], _buffers(), pad={"slot_mapping": -1})
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(9) == 16 and graphs.bucket_for(17) is None
    graphs.stage({"slot_mapping": torch.tensor([5, 9, 3]),
                  "block_tables": torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)}, 4)
    assert graphs.buffers["slot_mapping"][:4].tolist() == [5, 9, 3, -1]
    assert graphs.buffers["block_tables"][:4].tolist() == [[1, 2, 0, 0], [3, 4, 0, 0],
                                                            [5, 6, 0, 0], [0, 0, 0, 0]]


def test_pad_eagerly_runs_the_step_on_the_padded_bucket_and_returns_the_live_rows():
    seen = []

    def step(inputs):
        seen.append({name: t.clone() for name, t in inputs.items()})
        return inputs["slot_mapping"] * 2

    graphs = DecodeGraphs(step, _buffers(), pad={"slot_mapping": -1}, pad_eagerly=True)
    graphs.capture()
    out = graphs.run({"slot_mapping": torch.tensor([5, 9, 3]),
                      "block_tables": torch.ones(3, 2, dtype=torch.int32)})
    assert out.tolist() == [10, 18, 6]
    assert seen[0]["slot_mapping"].tolist() == [5, 9, 3, -1]
    assert seen[0]["block_tables"][3].tolist() == [0, 0, 0, 0]

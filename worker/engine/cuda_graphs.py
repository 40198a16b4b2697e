"""CUDA graphs for decode steps: capture once per bucketed batch size, replay with a padded batch.

A decode step launches hundreds of small kernels whose launch cost dwarfs their work at small
batch sizes; a captured graph replays them in one launch. Graphs bake in tensor addresses and
shapes, so inputs live in static buffers sized for the largest bucket, and a live batch of n rows
is copied in and padded up to the smallest bucket >= n. Padding rows must be harmless: slot -1
(no K/V write) and sequence length 0 (the decode kernel returns zeros for them). Off on CPU, where
`pad_eagerly` still stages and pads each batch and runs the step on the bucket without a graph, so
tests can check the padding.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16: padding wastes at most 15 rows of a decode step."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    """Runs `step(inputs) -> output` through a captured graph when one fits, else eagerly.

    `buffers` are the static inputs, batch first, each with room for `max_batch` rows (extra
    trailing dims, e.g. block-table columns, sized for the longest context). `pad` gives the value
    padding rows hold per buffer (default 0). `step` must only read the inputs it is handed (and
    state that does not change between steps, such as weights and KV caches) and return a tensor
    with the batch first. With `pad_eagerly`, a bucket without a graph still runs on the padded
    static buffers (eagerly) instead of on the live inputs.
    """

    def __init__(self, step: StepFn, buffers: Mapping[str, torch.Tensor],
                 pad: Mapping[str, float] | None = None, enabled: bool | None = None,
                 pad_eagerly: bool = False):
        self.step = step
        self.pad_eagerly = pad_eagerly
        self.buffers = dict(buffers)
        self.pad = dict(pad or {})
        self.max_batch = min(b.shape[0] for b in self.buffers.values())
        self.buckets = bucket_sizes(self.max_batch)
        on_cuda = all(b.is_cuda for b in self.buffers.values())
        self.enabled = on_cuda if enabled is None else enabled and on_cuda
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for name, buf in self.buffers.items():  # warm-up and capture then run on padding rows
            buf.fill_(self.pad.get(name, 0))

    def capture(self) -> None:
        """Largest bucket first, so the smaller ones reuse its memory pool."""
        if not self.enabled:
            return
        self.warm_up()
        pool = None
        for size in reversed(self.buckets):
            inputs = self.bucket_inputs(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step(inputs)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def warm_up(self) -> None:
        """Every bucket once on a side stream, torch's documented pattern before capture: Triton
        compiles, cuBLAS handles and lazy inits happen outside the graph, and the work they queue
        never mixes with the default stream's."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in reversed(self.buckets):
                self.step(self.bucket_inputs(size))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def bucket_inputs(self, size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:size] for name, buf in self.buffers.items()}

    def run(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        num_rows = next(iter(inputs.values())).shape[0]
        bucket = self.bucket_for(num_rows)
        if bucket in self.graphs:
            self.stage(inputs, bucket)
            graph, out = self.graphs[bucket]
            graph.replay()
        elif bucket is not None and self.pad_eagerly:
            self.stage(inputs, bucket)
            out = self.step(self.bucket_inputs(bucket))
        else:
            return self.step(dict(inputs))
        return out[:num_rows]

    def stage(self, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        """Copy the live rows into the static buffers; rows up to `bucket` get the pad value.

        Buffers not named in `inputs` keep what they hold (inputs constant across steps).
        """
        for name, src in inputs.items():
            buf = self.buffers[name]
            n = src.shape[0]
            buf[(slice(0, n), *(slice(0, s) for s in src.shape[1:]))].copy_(src, non_blocking=True)
            buf[n:bucket].fill_(self.pad.get(name, 0))

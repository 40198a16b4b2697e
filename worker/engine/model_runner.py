"""Owns the model, the paged KV cache and the sampler; runs one flattened batch per step.

Under tensor parallelism (ranks.py) every rank has a runner over its shard of the model and of the
KV cache (same blocks, same block tables, its own KV heads): rank 0 plans each step, sends the plan
(BatchInputs on the CPU) to the others, and alone samples; the others `serve()` plans until told to
stop."""
from __future__ import annotations

import logging
from collections.abc import Iterable
import os
from dataclasses import dataclass, replace
from functools import partial

import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.config import EngineConfig
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.dtype import choose_dtype
from worker.engine import pooling, prompt_logprobs
from worker.engine.pooling import PoolPlan
from worker.engine.prompt_logprobs import PromptScoring
from worker.engine.kv_budget import GROW, KVCacheFacts, KVCacheTooSmall, cdiv, cpu_budget, fit_max_model_len
from worker.engine.sampler import Sampler, SampleRow
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence
from worker.engine.types import TokenLogprob
from worker.models import gemm_probe
from worker.models.config import ModelConfig
from worker.models.gemm_probe import KernelChoice
from worker.models.linear import DEFAULT, use_kernel
from worker.models.loader import load_model
from worker.models.parallel import SINGLE, check_shardable

log = logging.getLogger("kvgate.worker")


def served_context(requested: int | None, cfg: ModelConfig) -> int:
    """The model's context, or the lowest cap on it (worker/models/config.py: LongRoPE's original
    context), said in a warning: past the cap the outputs would not be the model's. An explicit
    --max-model-len past it is a start-up error."""
    capped = cfg.context_cap()
    if capped is None:
        return cfg.max_position_embeddings
    cap, why = capped
    if requested is not None and requested > cap:
        raise ValueError(f"--max-model-len {requested} is past this model's {why}, {cap} tokens: kvgate "
                         f"serves the model exactly up to there; lower --max-model-len to at most {cap}")
    log.warning("max_model_len capped at the model's %s, %d tokens (its context is %d): kvgate serves "
                "the model exactly up to there", why, cap, cfg.max_position_embeddings)
    return cap


@dataclass
class BatchInputs:
    """One step's plan; built on the CPU, moved to the device by each rank."""

    input_ids: torch.Tensor  # [T] the new tokens of every scheduled sequence, end to end
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # batch rows whose chunk reaches the end of their tokens
    sample_tokens: torch.Tensor  # [len(sample_rows)] where those rows' last tokens sit in the batch
    scoring: PromptScoring | None = None  # prompt positions whose logprobs were asked for
    pooling: PoolPlan | None = None  # embedding inputs' positions whose states are pooled

    def to(self, device: torch.device) -> BatchInputs:
        to = dict(device=device, non_blocking=True)
        return BatchInputs(self.input_ids.to(**to), self.positions.to(**to), self.meta.to(device),
                           self.sample_rows, self.sample_tokens.to(**to),
                           self.scoring and self.scoring.to(device), self.pooling and self.pooling.to(device))


def make_backend(name: str, device: torch.device, head_dim: int, dtype: torch.dtype):
    """`auto` takes Triton on CUDA when it is importable, else torch with the native CPU kernels
    (compiled here, at start-up, not by the first decode step: decode attention, and the model's
    element-wise work and greedy argmax through `backend.kernels`); `torch` is the pure-torch
    reference."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from worker.engine.triton_attention import TritonAttentionBackend
        except ImportError:
            if name == "triton":
                raise
        else:
            return TritonAttentionBackend()
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}: auto, torch or triton")
    from worker.engine.torch_attention import TorchAttention

    backend = TorchAttention(native_decode=name == "auto")
    backend.prepare(head_dim, dtype, device)
    return backend


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, eos_token_ids: Iterable[int],
                 group=None):
        """`group`: this rank's TPGroup when ranks.py started it; rank 0 of a tensor-parallel
        engine passes none and starts the other ranks here."""
        self.device = config.torch_device()
        self.ranks = None
        if group is None and config.tensor_parallel_size > 1:
            from worker.engine.ranks import RankProcesses

            check_shardable(model_cfg, config.tensor_parallel_size)
            self.ranks = RankProcesses(config)
            group = self.ranks.group
        self.group = group
        self.shard = group.shard if group is not None else SINGLE
        self.dtype, why = choose_dtype(config.dtype, self.device, model_cfg.dtype, model_cfg.hidden_size,
                                       model_cfg.intermediate_size)
        log.info("dtype %s (%s)", _dtype_name(self.dtype), why)
        self.block_size = config.block_size
        self.backend = make_backend(config.attention_backend, self.device, model_cfg.head_dim, self.dtype)
        self.model = load_model(config.model_dir, model_cfg, self.device, self.dtype, self.backend, self.shard)
        self.cpu_kernels = getattr(self.backend, "kernels", None)  # native fp32 CPU kernels, if built
        self.model.cpu_kernels = self.cpu_kernels
        self.kernels = self._choose_kernels(config)
        self.num_kv_heads = self.shard.kv_heads(model_cfg.num_heads, model_cfg.num_kv_heads)[1]
        self.kv = self._size_kv_cache(config, model_cfg)
        self.num_blocks, self.max_model_len = self.kv.num_blocks, self.kv.max_model_len
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_cfg.num_layers)
        ]
        self.decode_prefetch = self._choose_prefetch(config, model_cfg)
        self.rank_memory = self._rank_memory()
        self.kv = replace(self.kv, tp_size=self.shard.size, ranks=tuple(self.rank_memory),
                          linear_kernel=self.kernels.label())
        self.sampler = Sampler(eos_token_ids, self.cpu_kernels)
        self.decode_graphs = self._build_decode_graphs(config)
        self.num_graph_steps = 0  # decode steps that went through decode_graphs

    def _choose_kernels(self, config: EngineConfig) -> KernelChoice:
        """The linears' GEMM path, timed on this CPU at the decode batch (tensor-parallel ranks keep
        the default: their layers call it directly)."""
        if self.shard.size > 1:
            return KernelChoice(DEFAULT, "default (tensor parallel)")
        choice = gemm_probe.choose(self.model, config.cpu_linear_kernel, self.device, self.dtype,
                                   min(config.max_num_seqs, 64))
        use_kernel(self.model, choice.kernel)
        log.info("linear kernel %s (%s)", choice.label(), choice.source,
                 extra={"linear_kernel": choice.label(), "linear_kernel_timings_ms": choice.timings_ms})
        return choice

    def _choose_prefetch(self, config: EngineConfig, model_cfg: ModelConfig) -> str:
        """Whether the native decode attention prefetches the next KV block: timed on this CPU over
        the caches just allocated (cpu_native.py); "n/a" without the native kernels or under
        tensor parallelism (its ranks share the cores, the timing would measure each other)."""
        if self.cpu_kernels is None or self.shard.size > 1:
            return "n/a"
        timings = self.cpu_kernels.choose_prefetch(self.kv_caches, model_cfg.num_heads,
                                                   min(config.max_num_seqs, 64))
        choice = "on" if self.cpu_kernels.prefetch else "off"
        log.info("decode attention prefetch %s", choice,
                 extra={"decode_prefetch": choice, "decode_prefetch_timings_ms": timings})
        return choice

    def _rank_memory(self) -> list[dict]:
        """Each rank's weight and KV bytes, in rank order (the registry and metrics report them)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        mine = {"rank": self.shard.rank, "pid": os.getpid(), "weight_bytes": weights, "kv_bytes": self.kv.bytes}
        return self.group.gather(mine) if self.group is not None else [mine]

    def close(self) -> None:
        """Stop the other ranks (rank 0 of a tensor-parallel engine; nothing otherwise)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    @torch.inference_mode()
    def _build_decode_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        """Triton only: its decode step reads nothing on the host that changes between steps.
        Captured on CUDA once the KV caches exist; on CPU only `pad_decode_eagerly` builds it.
        Not for a mixture of experts: its routing reads each expert's row count on the host."""
        if self.backend.name != "triton" or config.enforce_eager:
            return None
        if self.model.cfg.moe is not None:
            log.info("decode steps run without CUDA graphs: the mixture of experts routes on the host")
            return None
        if self.device.type != "cuda" and not config.pad_decode_eagerly:
            return None
        rows = min(config.max_cuda_graph_batch, config.max_num_seqs)
        width = cdiv(self.max_model_len, self.block_size)
        buffers = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "seq_lens": torch.zeros(rows, dtype=torch.int32, device=self.device),
            "block_tables": torch.zeros(rows, width, dtype=torch.int32, device=self.device),
        }
        query_start = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        graphs = DecodeGraphs(partial(self._decode_step, query_start), buffers, pad={"slot_mapping": -1},
                              enabled=not config.pad_decode_eagerly, pad_eagerly=config.pad_decode_eagerly)
        graphs.capture()
        return graphs

    def _decode_step(self, query_start: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of a decode-only batch. max_seq_len is the model's limit so the Triton split count
        depends on the batch size alone; the true lengths are on the device (host lists: bounds)."""
        n = inputs["input_ids"].shape[0]
        meta = AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], query_start_loc=query_start[:n + 1],
            seq_lens=inputs["seq_lens"], block_tables=inputs["block_tables"],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * n, seq_lens_cpu=[self.max_model_len] * n,
        )
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _block_bytes(self, cfg: ModelConfig) -> int:
        """This rank's bytes of one block: its KV heads only."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _size_kv_cache(self, config: EngineConfig, cfg: ModelConfig) -> KVCacheFacts:
        """Blocks from the budget (the weights are loaded by now), then the context they hold."""
        block_bytes, model_max = self._block_bytes(cfg), served_context(config.max_model_len, cfg)
        num_blocks, knob, source = self._pool_blocks(config, cfg, block_bytes, model_max)
        if self.group is not None:  # one block table for all ranks: the fewest any rank affords
            num_blocks = self.group.min_over_ranks(num_blocks)
        wanted = config.max_model_len or model_max
        if num_blocks < 1:
            need = cdiv(wanted, self.block_size)
            raise KVCacheTooSmall(f"the KV budget ({source}) leaves no room for a single block of "
                                  f"{self.block_size} tokens ({block_bytes} bytes): "
                                  + GROW[knob].format(bytes=need * block_bytes, blocks=need))
        max_len = fit_max_model_len(config.max_model_len, model_max, num_blocks,
                                    self.block_size, block_bytes, knob)
        return KVCacheFacts(num_blocks, self.block_size, block_bytes, max_len, _dtype_name(self.dtype),
                            source)

    def _pool_blocks(self, config: EngineConfig, cfg: ModelConfig, block_bytes: int,
                     model_max: int) -> tuple[int, str, str]:
        """(blocks, the setting that sized them, how in words): num_blocks (tests), the GPU share,
        --kv-cache-memory, or the CPU budget measured now."""
        if config.num_blocks:
            return config.num_blocks, "num_blocks", "num_blocks"
        if self.device.type == "cuda":
            return (self._gpu_blocks(config, cfg, block_bytes), "gpu_memory_utilization",
                    f"--gpu-memory-utilization {config.gpu_memory_utilization:g}")
        ranks = self.shard.size  # on CPU the ranks share one host's memory: each takes its share
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory // ranks // block_bytes, "kv_cache_memory", "--kv-cache-memory"
        budget, source = cpu_budget(block_bytes, self.block_size, config.max_num_seqs,
                                    config.max_model_len or model_max)
        return budget // ranks // block_bytes, "kv_cache_memory", source

    def _gpu_blocks(self, config: EngineConfig, cfg: ModelConfig, block_bytes: int) -> int:
        """The utilisation share of the card, minus what is in use and a reserve for one step's
        activations (weights are loaded by now)."""
        free, total = torch.cuda.mem_get_info(self.device)
        elem = torch.empty((), dtype=self.dtype).element_size()
        width = 8 * cfg.hidden_size + 4 * cfg.intermediate_size + 3 * cfg.num_heads * cfg.head_dim
        activations = config.max_num_batched_tokens * width * elem + 4 * config.max_num_seqs * cfg.vocab_size * 4
        budget = config.gpu_memory_utilization * total - (total - free) - activations
        return max(int(budget) // block_bytes, 0)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[tuple[Sequence, int | Exception, TokenLogprob | None]]:
        """Forward the batch; sample one token for each sequence whose chunk reached its end (or
        the exception sampling raised for that sequence alone); an embedding input's pooled state
        grows instead (Sequence.pooled)."""
        plan = self._prepare(batch)
        logits, scores, pooled = self.forward(plan) if self.ranks is None else self._forward_on_all_ranks(plan)
        if scores is not None:
            prompt_logprobs.collect(batch, plan.scoring, scores)
        if pooled is not None:
            pooling.collect(batch, plan.pooling, pooled)
        if logits is None:
            return []  # only partial prefill chunks: nothing to sample yet
        seqs = [batch[r][0] for r in plan.sample_rows]
        rows = [SampleRow(s.params, s.prompt_ids, s.output_ids, s.index, s.constraint) for s in seqs]
        tokens, logprobs = self.sampler.sample(logits, rows)
        return list(zip(seqs, tokens, logprobs))

    def _forward_on_all_ranks(self, plan: BatchInputs) -> tuple[torch.Tensor | None, tuple | None, list | None]:
        """A failure here leaves the ranks out of step (one may wait in a collective the others
        never reach): the group cannot go on, and the worker stops rather than hang."""
        try:
            self.group.send(plan)
            return self.forward(plan)
        except Exception as exc:
            self.ranks.abort(f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})")

    @torch.inference_mode()
    def forward(self, plan: BatchInputs) -> tuple[torch.Tensor | None, tuple | None, list | None]:
        """Every rank: the model over the plan; the logits of its sample rows (rank 0's whole), or
        None when no row samples; the prompt scores the plan asked for (prompt_logprobs.py); and
        rank 0's pooled states of embedding inputs (pooling.py: every rank holds the whole hidden
        states, so the others skip it)."""
        inputs = plan.to(self.device)
        if self._takes_decode_graph(inputs):
            return self._graph_logits(inputs), None, None
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        scores = None
        if inputs.scoring is not None:
            scores = prompt_logprobs.score(self.model.compute_logits, hidden, inputs.scoring,
                                           reduce=self.shard.rank == 0)
        pooled = pooling.pool(hidden, inputs.pooling) if inputs.pooling and self.shard.rank == 0 else None
        if not inputs.sample_rows:
            return None, scores, pooled
        return self.model.compute_logits(hidden[inputs.sample_tokens]), scores, pooled

    def serve(self) -> None:
        """Ranks 1..N-1: run each plan rank 0 sends, until it sends None."""
        while (plan := self.group.receive()) is not None:
            self.forward(plan)

    def _takes_decode_graph(self, inputs: BatchInputs) -> bool:
        """Decode-only, every row samples (so logits row i is batch row i), and a bucket fits."""
        meta = inputs.meta
        return (self.decode_graphs is not None and meta.is_decode_only and inputs.scoring is None
                and len(inputs.sample_rows) == meta.num_seqs <= self.decode_graphs.max_batch)

    def _graph_logits(self, inputs: BatchInputs) -> torch.Tensor:
        self.num_graph_steps += 1
        meta = inputs.meta
        return self.decode_graphs.run({
            "input_ids": inputs.input_ids, "positions": inputs.positions,
            "slot_mapping": meta.slot_mapping, "seq_lens": meta.seq_lens, "block_tables": meta.block_tables,
        })

    def _prepare(self, batch: ScheduledBatch) -> BatchInputs:
        if all(n == 1 for _, n in batch):
            return self._prepare_decode(batch)
        return self._prepare_any(batch)

    def _prepare_decode(self, batch: ScheduledBatch) -> BatchInputs:
        """`_prepare_any`'s plan for a step of one token per sequence (a decode step), its index
        arithmetic done on lists instead of ~15 small torch ops (~0.35 ms a step on CPU: 5 % of a
        decode step of the demo model at batch 32)."""
        bs = self.block_size
        starts = [seq.num_computed_tokens for seq, _ in batch]
        seq_lens = [s + 1 for s in starts]
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch],
                              dtype=torch.int32)
        slots = [seq.block_table[s // bs] * bs + s % bs for (seq, _), s in zip(batch, starts)]
        query_start = torch.arange(len(batch) + 1, dtype=torch.int32)
        sample_rows = [r for r, (seq, _) in enumerate(batch) if seq_lens[r] == seq.num_tokens and not seq.prefill_only]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=query_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
            max_query_len=1, max_seq_len=max(seq_lens),
            query_lens_cpu=[1] * len(batch), seq_lens_cpu=seq_lens,
        )
        input_ids = [seq.tokens(s, s + 1)[0] for (seq, _), s in zip(batch, starts)]
        return BatchInputs(torch.tensor(input_ids), torch.tensor(starts), meta, sample_rows,
                           torch.tensor(sample_rows, dtype=torch.long),
                           prompt_logprobs.plan_scoring(batch, starts, query_start),
                           pooling.plan_pooling(batch, starts, query_start))

    def _prepare_any(self, batch: ScheduledBatch) -> BatchInputs:
        bs = self.block_size
        starts = [seq.num_computed_tokens for seq, _ in batch]
        query_lens = [n for _, n in batch]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        input_ids = [t for (seq, n), s in zip(batch, starts) for t in seq.tokens(s, s + n)]
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch],
                              dtype=torch.int32)
        q_lens = torch.tensor(query_lens)
        query_start = torch.zeros(len(batch) + 1, dtype=torch.int32)
        query_start[1:] = q_lens.cumsum(0)
        row = torch.repeat_interleave(torch.arange(len(batch)), q_lens)
        offsets = torch.tensor(starts) - query_start[:-1]
        positions = torch.arange(len(input_ids)) + offsets[row]
        slots = tables[row, positions // bs].long() * bs + positions % bs
        sample_rows = [r for r, (seq, _) in enumerate(batch) if seq_lens[r] == seq.num_tokens and not seq.prefill_only]
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=query_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        )
        sample_tokens = query_start[1:][sample_rows] - 1
        return BatchInputs(torch.tensor(input_ids), positions, meta, sample_rows, sample_tokens.long(),
                           prompt_logprobs.plan_scoring(batch, starts, query_start),
                           pooling.plan_pooling(batch, starts, query_start))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

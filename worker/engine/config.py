"""Everything the paged engine is sized by, in one dataclass. The worker fills it from its settings by
field name (worker/main.py); each knob but NOT_SETTINGS is a WorkerSettings field and a `kvgate
worker` option of the same name, with the same default (tests/worker/test_engine_knobs.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# set by code or tests, not by an operator (model_dir is the setting `model`)
NOT_SETTINGS = frozenset({"model_dir", "num_blocks", "max_cuda_graph_batch", "pad_decode_eagerly"})


@dataclass
class EngineConfig:
    model_dir: str
    device: str = "auto"  # cpu, cuda, cuda:N or auto
    dtype: str = "auto"  # float32, bfloat16, float16 or auto (see dtype.py)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # KV bytes on CPU; None: measured (kv_budget.CPU_RULE)
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the whole process may use
    max_num_seqs: int = 64  # cap on running sequences
    max_num_batched_tokens: int | None = None  # token budget per step; None: by device, see below
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto, torch or triton
    cpu_linear_kernel: str = "auto"  # auto (timed at load, gemm_probe.py) or a linear.PATHS name
    num_blocks: int | None = None  # overrides the memory budget (tests)
    enforce_eager: bool = False  # vLLM's name: True turns off CUDA graphs for decode steps
    max_cuda_graph_batch: int = 256  # largest decode batch captured (capped by max_num_seqs)
    pad_decode_eagerly: bool = False  # tests: decode steps take the graphs' padded buffers, uncaptured
    structured_compile_timeout_s: float = 10.0  # a grammar not compiled by then fails its request
    structured_max_spec_bytes: int = 65536  # larger schemas, regexes, choices or grammars are refused
    structured_cache_mb: float = 512.0  # compiled grammars kept (vLLM's VLLM_XGRAMMAR_CACHE_MB); a larger one is refused
    structured_max_token_ms: float = 20.0  # a choice's grammar matching costing more a token (mean of 16) ends it
    reasoning_parser: str | None = None  # shared/reasoning.py's name; None: from the chat template
    task: str = "auto"  # auto (as the folder says), generate, embed or score (worker/models/pooling.py)
    score_tokens: str = ""  # task score on a causal LM: its answer tokens ("no,yes": comma-separated)
    score_template: str | None = None  # a reranker's pair template file (vLLM's score template)
    tensor_parallel_size: int = 1  # processes (one GPU each on CUDA) the model is sharded across
    tensor_parallel_timeout_s: float = 60.0  # a collective waiting longer fails: the worker exits

    def __post_init__(self):
        """A step's length bounds how long a new prompt waits for its first token. A GPU runs 2,048
        tokens in a few ms; a CPU needs ~100 ms for 1,024 tokens even of the demo model, so 256
        there (short requests' TTFT p99 beside long prompts: 7.6x alone at 2,048, 2.6x at 256)."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.torch_device().type == "cuda" else 256

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

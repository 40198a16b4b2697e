"""`kvgate bench engine --model DIR` runs W1-W3 on any model folder and names the CPU it ran on."""
import json
import subprocess
import sys


def test_bench_engine_runs_on_a_given_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, "-m", "kvgate", "bench", "engine", "--model", str(tiny_model_dir),
                           "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model"]["dir"] == str(tiny_model_dir) and report["model"]["hidden_size"] == 64
    assert report["cpu"] and f"on {report['cpu']}" in proc.stdout and "tiny-llama0" in proc.stdout
    assert report["w1"]["requests"] == 12 and report["w1"]["output_tokens"] > 0
    assert report["w1"]["dtype"] == "float32" and report["w2"]["hit_rate"] > 0.5
    assert report["w3"]["peak_concurrent"] > report["w3"]["reserved_seqs"] == 1


def test_a_mixture_of_experts_counts_the_experts_a_token_goes_through(tmp_path):
    """FLOPs per token: of 4 experts at top 2, half the experts' weights; all of everything else."""
    from kvgate.bench.engine import matmul_params
    from worker.engine.llm import LLM
    from worker.models.demo import build_model_dir

    folder = build_model_dir(tmp_path / "mixtral", arch="mixtral", vocab_size=512, hidden_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, intermediate_size=96,
                             config_extra=dict(num_local_experts=4, num_experts_per_tok=2))
    engine = LLM(folder, num_blocks=16).engine
    cfg = engine.model_config
    q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 4 * hidden  # attention, the router
    expert = 3 * hidden * 96  # gate, up, down
    assert matmul_params(engine) == 2 * (per_layer + 2 * expert) + cfg.vocab_size * hidden

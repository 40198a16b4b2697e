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

"""`kvgate bench structured --model DIR --quick` runs on any folder and writes the issue's JSON keys."""
import json
import subprocess
import sys


def test_bench_structured_writes_its_figures(tiny_model_dir, tmp_path):
    out = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, "-m", "kvgate", "bench", "structured", "--model", str(tiny_model_dir),
                           "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    s = report["structured"]
    assert report["model"]["dir"] == str(tiny_model_dir) and report["cpu"] in proc.stdout
    assert s["requests"] == 16 and s["rounds"] == 1 and s["output_tokens"] >= 16 and s["schemas"] == 8
    assert s["vs_free"] > 0 and 0 < s["compile_ms_p50"] <= s["compile_ms_p99"]
    assert "structured.vs_free" in proc.stdout and "structured.compile_ms_p99" in proc.stdout

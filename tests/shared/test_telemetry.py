"""Spans cost nothing while tracing is off, and record once a provider is installed. In a fresh
interpreter: installing tracing is once per process, and another test installs it."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from shared import telemetry

    @telemetry.traced("inner")
    async def work():
        return trace.get_current_span(), trace.get_current_span().is_recording()

    with telemetry.span("off") as span:
        assert span is trace.INVALID_SPAN
        assert trace.get_current_span() is trace.INVALID_SPAN  # no context attached
        assert telemetry.inject() == {}
    assert asyncio.run(work()) == (trace.INVALID_SPAN, False)

    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("test", exporter=exporter, simple=True)
    with telemetry.span("on") as span:
        assert span.is_recording()
        assert "traceparent" in telemetry.inject()
        assert asyncio.run(work())[1]
    print(sorted(s.name for s in exporter.get_finished_spans()))
""")


def test_spans_are_nothing_until_tracing_is_installed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['inner', 'on']"

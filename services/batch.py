"""Runs one batch: checks its input file line by line (a bad line goes to the error file with the
reason), sends the good ones to the gateway a bounded number at a time, retries what is transient,
and writes OpenAI's output and error files.

Lines go through the gateway's own HTTP API, with a token derived from the server secret that
stands for the batch's owner (`shared.batches.line_token`). So every line is governed exactly as
the owner's interactive requests are, by the one code path that does it (the key's allowed models,
rate limits and token budgets, routing, context checks, usage), its response body is the one a
client would get, and the gateway puts it in the batch lane at a low engine priority. Calling the
gateway's functions from here instead would mean a second copy of that path, which would drift.

Results are appended to a progress file under the data directory as they come, so a runner that
dies is resumed (by the maintenance beat) from where it was, and the final counts are counted from
the same records the files are written from: `completed` is the output file's lines, `failed` the
error file's. The output and error files are written from the progress file one record at a time,
in input order, through an index of where each line's record is: no step holds every result in
memory. They count against the owner's stored-data quota: a batch may only start with room left,
and once its results take what the quota left when it started running, its remaining lines are not
sent (each fails with quota_exceeded); what came back is never thrown away. Without that a key's
batches wrote as fast as the fleet generated (with logprobs, ~700 bytes a token), past any quota.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis

from services.batch_lines import Input, Line
from services.batch_results import Entry, Progress, result, succeeded, tally, usage_of
from shared import names
from shared.batches import Acquired, Batch, BatchStore, line_token
from shared.files import FileStore, NewFile
from shared.redis_client import async_client
from shared.settings import ServicesSettings

log = logging.getLogger("kvgate.services.batch")
LEASE_S = 30.0  # a runner's hold on its batch; renewed every WATCH_S, so only a dead one lapses
WATCH_S = 0.5  # how often a runner renews its lease and looks for a cancel or the deadline
BACKOFF_S, BACKOFF_CAP_S = 0.5, 30.0
TRANSIENT = {502, 503, 504}  # answers worth retrying (429 too, by pausing the whole batch)
YIELD_POLL_S = 0.05  # how often held-back senders look whether interactive traffic has stopped


class Stopped(Exception):
    """The batch left in_progress (cancelled) while a line was on its way."""


class Runner:
    def __init__(self, settings: ServicesSettings, redis: aioredis.Redis, batch_id: str):
        self.s = settings
        self.id = batch_id
        retention_s = settings.file_retention_s
        self.redis = redis
        self.store = BatchStore(redis, retention_s)
        self.files = FileStore(redis, settings.data_dir, retention_s)
        self.progress = Progress(Path(settings.data_dir) / "batches" / f"{batch_id}.jsonl")
        self.pause_until = 0.0  # a 429 slows the whole batch down to the key's limits
        self.transport: httpx.AsyncBaseTransport | None = None  # tests: a gateway stand-in
        self._marks: dict[str, tuple[float, bool]] = {}  # model -> (looked at, interactive busy)
        self.held_s = 0.0  # sender-seconds spent yielding to interactive traffic
        self.input: Input | None = None  # while the batch's lines are sent
        self.room: int | None = None  # bytes the results may take (None: no quota)
        self.full = ""  # why a line is not sent once they have

    async def run(self) -> str:
        """What happened, in a few words (the Celery task's result, and its log line)."""
        held = await self.store.acquire(self.id, LEASE_S, self.s.batch_max_running)
        if held is not Acquired.OURS:
            return ("another runner has it" if held is Acquired.HELD_ELSEWHERE
                    else "waiting: enough batches running")
        try:
            batch = await self.store.runnable(self.id)
            return "nothing to do" if batch is None else await self._run(batch)
        finally:
            await self.store.release(self.id)

    async def _run(self, batch: Batch) -> str:
        if batch.status == "cancelling":
            return await self._finalize(batch, [], "cancelled")
        opened = await self._open(batch)
        if opened is None:
            return "failed"
        self.input, lines = opened
        try:
            return await self._run_lines(batch, lines)
        finally:
            self.input.close()

    async def _run_lines(self, batch: Batch, lines: list[Line]) -> str:
        if batch.status == "validating":
            await self.store.update(self.id, total=len(lines),
                                    model=next((ln.model for ln in lines if ln.model), None))
            moved, _ = await self.store.move(self.id, "in_progress", "validating")
            if not moved:  # cancelled while validating
                return await self._finalize(batch, lines, "cancelled")
        done = self.progress.index()
        await self.store.update(self.id, **tally(done.values()))  # resumed: as far as it got
        await self._measure_room(batch)
        for line in lines:
            if line.error is not None and line.number not in done:
                await self._record(line, result(line, error=line.error))
        todo = [ln for ln in lines if ln.span is not None and ln.number not in done]
        ending = await self._send_all(batch, todo)
        return await self._finalize(batch, lines, ending)

    async def _measure_room(self, batch: Batch) -> None:
        """What the results may take: the owner's byte quota less what it keeps now (its files,
        this batch's input among them; the results so far are not a file yet)."""
        if batch.max_stored_bytes is None:
            return
        kept = (await self.store.quota.usage(batch.owner)).bytes
        self.room = batch.max_stored_bytes - kept
        self.full = (f"This line was not run: the batch's results took what its owner's stored-data "
                     f"quota left (max_stored_bytes: Limit {batch.max_stored_bytes}, Used {kept} when "
                     "the batch started). Delete files to make room.")

    async def _open(self, batch: Batch) -> tuple[Input, list[Line]] | None:
        """The input file and its lines; None when the batch cannot run at all (and has failed)."""
        record = await self.files.find(batch.input_file_id)
        why = None
        try:
            source = Input(self.files.path(record.id)) if record is not None else None
        except FileNotFoundError:
            source = None
        if source is None:
            why = ("file_not_found", f"Input file {batch.input_file_id} no longer exists")
        elif self.s.secret is None:
            why = ("server_error", "The batch runner has no KVGATE_SECRET to send lines with")
        else:
            try:
                lines = await asyncio.to_thread(source.lines, batch.endpoint)
                if lines:
                    return source, lines
                why = ("empty_file", "The input file has no lines")
            except UnicodeDecodeError:
                why = ("invalid_file", "The input file is not UTF-8")
        if source is not None:
            source.close()
        await self.store.update(self.id, errors=[{"code": why[0], "message": why[1]}])
        await self.store.finish(batch, "failed", "validating", "in_progress")
        log.warning("batch %s failed: %s", self.id, why[1])
        return None

    # -- sending ---------------------------------------------------------------------------
    async def _send_all(self, batch: Batch, todo: list[Line]) -> str:
        """Send every line, `batch_concurrency` at a time; 'completed', or why it stopped early
        ('cancelled', 'expired'), in which case the lines still on their way are abandoned."""
        queue: asyncio.Queue[Line] = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)
        headers = {"Authorization": f"Bearer {line_token(self.s.secret.get_secret_value(), self.id)}"}
        limits = httpx.Limits(max_connections=self.s.batch_concurrency)
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(base_url=self.s.gateway_url, headers=headers, limits=limits,
                                     timeout=timeout, transport=self.transport) as http:
            senders = [asyncio.create_task(self._sender(http, batch.endpoint, queue, slot))
                       for slot in range(min(self.s.batch_concurrency, len(todo)))]
            watcher = asyncio.create_task(self._watch(batch))
            all_sent = asyncio.gather(*senders)
            try:
                await asyncio.wait({all_sent, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    return watcher.result()
                try:
                    all_sent.result()
                except Stopped:  # the gateway refused a line: the batch was cancelled meanwhile
                    return "cancelled"
                return "completed"
            finally:
                watcher.cancel()
                for task in senders:  # closing their requests makes the gateway cancel them
                    task.cancel()
                await asyncio.gather(*senders, return_exceptions=True)

    async def _watch(self, batch: Batch) -> str:
        """Keeps the lease; returns when the batch must stop: 'cancelled' or 'expired'."""
        while True:
            await asyncio.sleep(WATCH_S)
            await self.store.renew(self.id, LEASE_S)
            if (await self.store.status(self.id)) == "cancelling":
                return "cancelled"
            if batch.expires_at is not None and time.time() >= batch.expires_at:
                return "expired"

    async def _sender(self, http: httpx.AsyncClient, endpoint: str, queue: asyncio.Queue,
                      slot: int) -> None:
        last_s = 0.0  # how long this sender's last line took
        while not queue.empty():
            line = queue.get_nowait()
            if self.room is not None and self.progress.bytes >= self.room:
                await self._record(line, result(line, error=("quota_exceeded", self.full)))
                continue
            await self._yield_to_interactive(slot, line.model, last_s)
            started = time.monotonic()
            await self._record(line, await self._send(http, endpoint, line))
            last_s = time.monotonic() - started

    async def _yield_to_interactive(self, slot: int, model: str, last_s: float) -> None:
        """While the model has interactive traffic (the gateway keeps a short-lived mark per
        model), senders past `batch_concurrency_busy` wait, and the others send only
        `batch_busy_duty` of the time, resting after each line in proportion to how long it took.
        Each line costs the gateway, the engine and, on one machine, the CPU that interactive
        requests need; so the batch takes only what people leave, and runs at full width once
        they are gone."""
        started = time.monotonic()
        if await self._interactive_busy(model):
            await asyncio.sleep(last_s * (1 / self.s.batch_busy_duty - 1))
        while slot >= self.s.batch_concurrency_busy and await self._interactive_busy(model):
            await asyncio.sleep(YIELD_POLL_S)
        self.held_s += time.monotonic() - started

    async def _interactive_busy(self, model: str) -> bool:
        """Whether the model's interactive mark is set; looked up at most once per poll interval."""
        looked, busy = self._marks.get(model, (0.0, False))
        if time.monotonic() - looked >= YIELD_POLL_S:
            busy = bool(await self.redis.exists(names.interactive_mark(model)))
            self._marks[model] = (time.monotonic(), busy)
        return busy

    async def _send(self, http: httpx.AsyncClient, endpoint: str, line: Line) -> dict:
        """The line's result: the gateway's answer, retried while it is transient (503, a lost
        connection: up to `batch_max_attempts` with backoff; 429: the batch pauses for as long as
        the gateway says, and that costs no attempt)."""
        request = self.input.body(line)
        attempt = 0
        while True:
            if (wait := self.pause_until - time.time()) > 0:
                await asyncio.sleep(wait)
            attempt += 1
            try:
                resp = await http.post(endpoint, json=request)
            except httpx.TransportError as exc:
                if attempt >= self.s.batch_max_attempts:
                    return result(line, error=("connection_error", f"The gateway could not be "
                                               f"reached after {attempt} tries: {type(exc).__name__}"))
                await asyncio.sleep(_backoff(attempt))
                continue
            body = _json(resp)
            code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
            if resp.status_code == 401 and code == "batch_not_running":
                raise Stopped
            if resp.status_code == 429 and code != "insufficient_quota":
                attempt -= 1
                self.pause_until = max(self.pause_until, time.time() + _retry_after(resp, attempt))
                continue
            if resp.status_code in TRANSIENT and attempt < self.s.batch_max_attempts:
                await asyncio.sleep(max(_retry_after(resp, attempt), _backoff(attempt)))
                continue
            return result(line, status=resp.status_code, request_id=resp.headers.get("x-request-id"),
                          body=body)

    async def _record(self, line: Line, record: dict) -> None:
        self.progress.append(line.number, record)
        usage = usage_of(record)
        if succeeded(record):
            await self.store.add(self.id, completed=1, prompt_tokens=usage.get("prompt_tokens", 0),
                                 completion_tokens=usage.get("completion_tokens", 0))
        else:
            await self.store.add(self.id, failed=1)

    # -- the end ---------------------------------------------------------------------------
    async def _finalize(self, batch: Batch, lines: list[Line], ending: str) -> str:
        """Write the output and error files from the progress records, set the counts from the
        same records, then the final status. A cancel that raced a completion wins."""
        if ending == "completed":
            moved, status = await self.store.move(self.id, "finalizing", "in_progress")
            if not moved:
                ending = "cancelled" if status == "cancelling" else ending
        done = self.progress.index()
        unrun = {}  # OpenAI's way: what did not run before the batch expired is reported as expired
        if ending == "expired":
            unrun = {ln.number: result(ln, error=("batch_expired", "This line was not run before "
                                                  "the batch expired")) for ln in lines
                     if ln.number not in done}
        written = await asyncio.to_thread(self._write_results, batch, done, unrun)
        output, errors = [await self._publish(new) for new in written]
        counts = tally([*done.values(), *map(Entry.of, unrun.values())])
        await self.store.update(self.id, total=len(lines) or None, output_file_id=output,
                                error_file_id=errors, **counts)
        sources = {"completed": ("finalizing",), "cancelled": ("cancelling", "validating"),
                   "expired": ("in_progress", "validating")}[ending]
        if not await self.store.finish(batch, ending, *sources):
            await self.store.finish(batch, "cancelled", "cancelling")
        self.progress.path.unlink(missing_ok=True)
        status = await self.store.status(self.id)
        log.info("batch %s %s: %d completed, %d failed; senders held back %.1f s for interactive "
                 "traffic", self.id, status, counts["completed"], counts["failed"], self.held_s)
        return f"{status}: {counts['completed']} completed, {counts['failed']} failed"

    def _write_results(self, batch: Batch, done: dict[int, Entry],
                       unrun: dict[int, dict]) -> tuple[NewFile, NewFile]:
        """The output and error files, in input order, one record at a time (in a thread)."""
        output = self.files.begin(batch.owner, "batch_output", f"{batch.id}_output.jsonl")
        errors = self.files.begin(batch.owner, "batch_output", f"{batch.id}_error.jsonl")
        try:
            with open(self.progress.path, "rb") if done else contextlib.nullcontext() as progress:
                for number in sorted({*done, *unrun}):
                    entry = done.get(number)
                    record = unrun[number] if entry is None else Progress.read(progress, entry)
                    (output if entry is not None and entry.ok else errors).write(
                        orjson.dumps(record) + b"\n")
        except BaseException:
            output.discard()
            errors.discard()
            raise
        return output, errors

    async def _publish(self, new: NewFile) -> str | None:
        """The file's id, or None (and no file) when it has no lines."""
        if new.size == 0:
            new.discard()
            return None
        return (await self.files.commit(new)).id


def _json(resp: httpx.Response):
    try:
        return resp.json()
    except ValueError:
        return {"error": {"message": resp.text[:500], "type": "server_error", "param": None,
                          "code": None}}


def _backoff(attempt: int) -> float:
    return min(BACKOFF_CAP_S, BACKOFF_S * 2 ** (attempt - 1))


def _retry_after(resp: httpx.Response, attempt: int) -> float:
    try:
        return min(BACKOFF_CAP_S, float(resp.headers["retry-after"]))
    except (KeyError, ValueError):
        return _backoff(max(1, attempt))


def run_batch(settings: ServicesSettings, batch_id: str) -> str:
    """One batch, from synchronous code (the Celery task)."""
    async def once() -> str:
        client = async_client(settings, socket_connect_timeout=2, socket_timeout=10)
        try:
            return await Runner(settings, client, batch_id).run()
        finally:
            await client.aclose()
    return asyncio.run(once())

"""Every Redis key and channel name, defined once. All keys share the `kvgate:` prefix.

Hash tags (`{...}`) put the keys one atomic step touches in one Redis Cluster slot, so the same code
runs on one Redis, Sentinel or a cluster: `model_tag` per served name, `key_tag` per API key. Every
multi-key operation and its tag (or why it is split) is listed in docs/redis-keys.md. Changing the
names needs a full stop of the fleet (no rolling upgrade across it): queued entries keep old names.
"""
from __future__ import annotations

PREFIX = "kvgate"
DEFAULT_LANE = "interactive"
BATCH_LANE = "batch"
CONSUMER_GROUP = "workers"
MODEL_NAME_CHARS = 256  # a model name is at most this long: it is part of key names (gateway/bounds.py)


def model_tag(model: str) -> str:
    """One slot per served name: the bounded XADD also sets the model's interactive mark, a worker
    reads both lanes in one XREADGROUP, a canary rescue moves entries between versions atomically."""
    return "{m:" + model + "}"


def key_tag(key_id: str) -> str:
    """One slot per API key: a token reservation charges its minute and its day in one script."""
    return "{k:" + key_id + "}"


def request_stream(model: str, version: str, lane: str = DEFAULT_LANE) -> str:
    """The stream a gateway XADDs to and the workers of (model, version) consume."""
    return f"{PREFIX}:req:{model_tag(model)}:{version}:{lane}"


def interactive_mark(model: str) -> str:
    """Set, with a short TTL, on every interactive request for a model name: while it exists, batch
    runners send that model's lines only a few at a time (the batch lane yields to people)."""
    return f"{PREFIX}:interactive:{model_tag(model)}"


def reply_channel(gateway_id: str) -> str:
    """Pub/sub channel a gateway process listens on for the deltas of its own requests."""
    return f"{PREFIX}:reply:{gateway_id}"


CANCEL_CHANNEL = f"{PREFIX}:cancel"
KEYS_CHANGED_CHANNEL = f"{PREFIX}:keys:changed"  # a key record was written: its id (gateway caches)


def cancelled_key(request_id: str) -> str:
    """Marker (with TTL) so a cancel that arrives before any worker picked the entry still counts."""
    return f"{PREFIX}:cancelled:{request_id}"


WORKERS_ZSET = f"{PREFIX}:workers"


def worker_key(worker_id: str) -> str:
    """A worker's registry entry (JSON, with a TTL refreshed by its heartbeat)."""
    return f"{PREFIX}:worker:{worker_id}"


def model_versions_key(served_name: str) -> str:
    """Hash version → info of every version ever served under a name (bounded by versions). `{m:}`:
    beside its streams, so a scrape's reads of a model go to one node."""
    return f"{PREFIX}:model:{model_tag(served_name)}"


SERVED_NAMES = f"{PREFIX}:served"  # set of every served name ever registered (metrics list them)


def permanent_keys(served_name: str, version: str) -> set[str]:
    """The request path's keys allowed to live without a TTL, each bounded by something other than
    traffic: the worker set (live workers), the version hash (versions), the version's two streams
    (every entry is XDELed once answered), the open-streams index (streams held now; settled ones
    leave it) and the served names (names). docs/redis-keys.md, "Permanent keys"."""
    return {WORKERS_ZSET, SERVED_NAMES, model_versions_key(served_name), request_stream(served_name, version),
            request_stream(served_name, version, BATCH_LANE), OPEN_STREAMS}


def served_name_of(versions_key: str) -> str:
    """The served name a `model_versions_key` is of (metrics find them by SCAN when SERVED_NAMES,
    which came later, is empty)."""
    return versions_key[len(model_versions_key("")) - 1:-1]


# -- governance: keys, limits, usage ---------------------------------------------------------
KEY_NAMES = f"{PREFIX}:keynames"  # hash: key name -> key id (names are unique)


def key_record(key_id: str) -> str:
    """Hash of one API key: `record` (JSON, never a secret) and `digest` (HMAC of the current secret)."""
    return f"{PREFIX}:key:{key_id}"


def key_digest(digest: str) -> str:
    """HMAC-SHA256(server secret, key secret) -> key id; a rotated-out digest carries a TTL (grace)."""
    return f"{PREFIX}:keydigest:{digest}"


def rpm_key(key_id: str) -> str:
    """Sorted set request -> time: a key's requests of the last minute (the moving window; TTL).
    `{k:}`: beside its slots and tokens, so a request's admission is one script."""
    return f"{PREFIX}:rpm:{key_tag(key_id)}"


def inflight_key(key_id: str) -> str:
    """Sorted set request id -> expiry: a key's requests in flight (stale members age out)."""
    return f"{PREFIX}:inflight:{key_tag(key_id)}"


def tpm_key(key_id: str) -> str:
    """Hash second -> tokens charged in that second, the last minute of a key (with a TTL)."""
    return f"{PREFIX}:tpm:{key_tag(key_id)}"


def daily_tokens_key(key_id: str, day: str) -> str:
    """Tokens a key used on one UTC day (YYYYMMDD), with a TTL past the day's end."""
    return f"{PREFIX}:daily:{key_tag(key_id)}:{day}"


def usage_key(key_id: str, day: str) -> str:
    """Hash `model|version|counter` -> count of one key on one UTC day (with a retention TTL). `{k:}`:
    in the slot of the key's token counters, on the node its other per-key traffic goes to."""
    return f"{PREFIX}:usage:{key_tag(key_id)}:{day}"


USAGE_DAYS_TO_FOLD = f"{PREFIX}:usagefold"  # sorted set UTC day -> when it ends: days awaiting roll-up


def usage_rollup(day: str) -> str:
    """Hash `key_id|model|version|counter` -> count: one UTC day of every key, folded (retention TTL)."""
    return f"{PREFIX}:usagesum:{day}"


def usage_day_index(day: str) -> str:
    """Set of the key ids with usage on one UTC day (same TTL as the usage hashes)."""
    return f"{PREFIX}:usagekeys:{day}"


# -- canary releases: routes per alias, their events and counters, the analysis window ---------
CANARY_ROUTES = f"{PREFIX}:routes"  # set of the aliases (served names) that have a route


def canary_route(alias: str) -> str:
    """JSON of one alias's route (stable, canary, weight, steps, thresholds); changed by CAS only.
    The canary's keys carry `{m:<alias>}`: an alias's route, events, counters, windows and streams
    share a node, so the analysis reads its windows in one round trip and a rescue's move and count
    could share a transaction."""
    return f"{PREFIX}:route:{model_tag(alias)}"


def canary_events(alias: str) -> str:
    """List of an alias's last route events (set, advance, promote, rollback ...), newest first,
    trimmed to a fixed length on every push."""
    return f"{PREFIX}:canary:events:{model_tag(alias)}"


def canary_counters(alias: str) -> str:
    """Hash counter -> n of one alias: rollbacks, promotions, failovers, rescued entries."""
    return f"{PREFIX}:canary:counts:{model_tag(alias)}"


def canary_window(alias: str, version: str, bucket: int) -> str:
    """Hash of what one version served in one time bucket (requests, errors, TTFT and TPOT
    histograms); its TTL is the route's analysis window, so the window slides by itself."""
    return f"{PREFIX}:canary:win:{model_tag(alias)}:{version}:{bucket}"


def breaker_state(model: str, version: str) -> str:
    """Hash of an unhealthy version's circuit breaker (state, until, probe); absent: closed (TTL).
    `{m:}`: beside its failure window, so each step of the breaker is one script."""
    return f"{PREFIX}:breaker:{model_tag(model)}:{version}"


def breaker_failures(model: str, version: str) -> str:
    """Sorted set of a version's recent failures (member -> ms), trimmed to the window (TTL)."""
    return f"{PREFIX}:breaker:fails:{model_tag(model)}:{version}"


CELERY_PREFIX = f"{PREFIX}:celery:"  # every key Celery (broker, beat) keeps in Redis starts so


def checkpoint_key(request_id: str) -> str:
    """List of every reply published for a request, in order (TTL): the resume and gap log."""
    return f"{PREFIX}:ckpt:{request_id}"


# -- streams that survive their gateway (gateway/stream_leases.py) ----------------------------
def stream_resumes(key_id: str, request_id: str) -> str:
    """Counter of one stream's resumes in the minute since the first of them (TTL 60 s), under its
    key's tag like its lease."""
    return f"{PREFIX}:resumes:{key_tag(key_id)}:{request_id}"


def stream_lease(key_id: str, request_id: str) -> str:
    """Hash of what one streamed request holds (slot, token reservation, usage to record) and who
    serves its client until when; settled once, by whichever gateway claims it first (TTL). Named
    under its key, so a resume by another key finds nothing (404)."""
    return f"{PREFIX}:stream:{key_tag(key_id)}:{request_id}"


OPEN_STREAMS = f"{PREFIX}:streams:open"  # sorted set `<key id>/<request id>` -> held until: what
# the gateways' sweepers settle once nobody holds it (its gateway died, its client never came back)


# -- files and batch jobs (/v1/files, /v1/batches) -------------------------------------------
def file_record(file_id: str) -> str:
    """JSON of one uploaded or generated file (its bytes live under the data directory)."""
    return f"{PREFIX}:file:{file_id}"


def files_of(key_id: str) -> str:
    """Sorted set file id -> created time: the files one key owns (`{k:}`: with its quota, in the
    transaction that adds or drops a file)."""
    return f"{PREFIX}:files:{key_tag(key_id)}"


FILES_EXPIRY = f"{PREFIX}:files:expiry"  # sorted set file id -> expiry time, swept by maintenance


def batch_record(batch_id: str) -> str:
    """Hash of one batch: `record` (JSON, what never changes), `status`, `{status}_at` times,
    request counters, token counters, result file ids. Status moves by compare-and-set only."""
    return f"{PREFIX}:batch:{batch_id}"


def batches_of(key_id: str) -> str:
    """Sorted set batch id -> created time: the batches one key owns (`{k:}`: its owner's slot)."""
    return f"{PREFIX}:batches:{key_tag(key_id)}"


BATCHES_ACTIVE = f"{PREFIX}:batches:active"  # set of batch ids not yet in a final status
BATCHES_RUNNING = f"{PREFIX}:batches:running"  # sorted set batch id -> runner lease expiry


def stored_by(key_id: str) -> str:
    """Hash of what one key keeps, one entry per thing, for its quotas (shared/quota.py):
    `f:{file id}` -> bytes, `u:{upload}` -> `bytes:expiry`, `b:{batch id}` -> deadline. `{k:}`:
    changed in one transaction with the owner's list of files."""
    return f"{PREFIX}:quota:{key_tag(key_id)}"


# -- stored responses (/v1/responses with store: true) ----------------------------------------
def stored_response(key_id: str, response_id: str) -> str:
    """JSON of one stored response and the conversation it ended (TTL: the retention); under its
    key's tag, so another key's id names another key."""
    return f"{PREFIX}:resp:{key_tag(key_id)}:{response_id}"


def stored_responses(key_id: str) -> str:
    """Hash response id -> `bytes:expiry` of a key's stored responses: its size quota (the same slot
    as the responses, so a store and its quota check are one script)."""
    return f"{PREFIX}:resps:{key_tag(key_id)}"


def stored_response_expiries(key_id: str) -> str:
    """Sorted set of the key's counted stored responses by expiry: the expired ones are found
    without reading the whole quota hash."""
    return f"{PREFIX}:respx:{key_tag(key_id)}"


def stored_response_bytes(key_id: str) -> str:
    """The bytes of the key's counted stored responses, kept as each is stored, deleted or expires."""
    return f"{PREFIX}:respb:{key_tag(key_id)}"


def celery_queue(queue: str) -> str:
    """The Redis list that holds the waiting task messages of one Celery queue."""
    return f"{CELERY_PREFIX}{queue}"

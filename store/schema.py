"""The store's tables, and the migrations that bring a store of any earlier schema to them.

Both databases run the same statements (`{serial}` and `{without_rowid}` are each one's own spelling,
store.base.Database): a migration is plain SQL that SQLite and PostgreSQL both take, and it keeps the
history, filling what a new column says of the sessions stored before it where their rows tell.
"""

from __future__ import annotations

from kvwatch.collectors.probe.records import REUSED_SHARE

SCHEMA_VERSION = 8
# The warm rounds of the session `sessions.id` that SessionResult judges reuse by, in SQL.
_WARM = (
    "FROM rounds r WHERE r.session = sessions.id AND r.round > 1 AND r.error_kind IS NULL "
    "AND r.cached_tokens IS NOT NULL AND r.ideal_cached_tokens > 0"
)
# The sessions stored before schema 6, judged from their rounds as SessionResult judges them: by the
# replica when rounds named theirs (backend_switches), else by reuse where warm rounds were (sticky).
_EVIDENCE_OF_STORED_SESSIONS = f"""UPDATE sessions SET
        warm_rounds = (SELECT count(*) {_WARM}),
        warm_rounds_reused = (
            SELECT count(*) {_WARM} AND r.cached_tokens >= {REUSED_SHARE} * r.ideal_cached_tokens
        ),
        warm_cached_tokens = (SELECT sum(r.cached_tokens) {_WARM}),
        warm_ideal_cached_tokens = (SELECT sum(r.ideal_cached_tokens) {_WARM}),
        evidence = CASE WHEN backend_switches IS NOT NULL THEN 'replica'
            WHEN sticky IS NOT NULL THEN 'reuse' ELSE 'none' END"""

# What a session's life adds to its row: how its route session ended (closed: CLOSE said so; close_gone:
# a second CLOSE found it gone), the route sessions lost before a round (JSON [[round, kind], ...]), and
# after an idle past the TTL, its round and seconds and what followed (lifecycle.SessionLife).
LIFE_COLUMNS = (
    ("closed", "INTEGER"),
    ("close_gone", "INTEGER"),
    ("session_losses", "TEXT"),
    ("idle_after_round", "INTEGER"),
    ("idle_seconds", "DOUBLE PRECISION"),
    ("idle_expiry", "TEXT"),
    ("idle_cold", "INTEGER"),
    ("idle_new_replica", "INTEGER"),
    ("idle_repinned", "INTEGER"),
    ("idle_as_expected", "INTEGER"),
)

SCHEMA = (
    """CREATE TABLE sessions (
        id {serial},
        target TEXT NOT NULL,
        route_mode TEXT NOT NULL,
        session_id TEXT,
        started_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION NOT NULL,
        ok INTEGER NOT NULL,
        error_kind TEXT,
        sticky INTEGER,
        backend_switches INTEGER,
        session_id_echoed INTEGER,
        interrupted INTEGER NOT NULL DEFAULT 0,
        uid TEXT,
        in_flight INTEGER NOT NULL DEFAULT 0,
        writer INTEGER,
        evidence TEXT,
        warm_rounds INTEGER,
        warm_rounds_reused INTEGER,
        warm_cached_tokens INTEGER,
        warm_ideal_cached_tokens INTEGER,
        """
    + ",\n        ".join(f"{column} {kind}" for column, kind in LIFE_COLUMNS)
    + "\n    )",
    "CREATE INDEX sessions_by_time ON sessions (started_at)",
    "CREATE INDEX sessions_by_target ON sessions (target, started_at)",
    "CREATE UNIQUE INDEX sessions_by_uid ON sessions (uid)",
    """CREATE TABLE rounds (
        session INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        round INTEGER NOT NULL,
        started_at DOUBLE PRECISION NOT NULL,
        status INTEGER,
        error_kind TEXT,
        error_detail TEXT,
        ttft_seconds DOUBLE PRECISION,
        total_seconds DOUBLE PRECISION,
        prompt_tokens INTEGER,
        cached_tokens INTEGER,
        ideal_cached_tokens INTEGER,
        completion_tokens INTEGER,
        backend TEXT,
        session_id_sent TEXT,
        session_id_returned TEXT,
        first_content_seconds DOUBLE PRECISION,
        pin_outcome TEXT,
        PRIMARY KEY (session, round)
    ) {without_rowid}""",
    # Alertmanager repeats a group's alerts in every notification: one row per alert per state
    # (fingerprint, status, starts_at) keeps the first receipt, which is what detection latency needs.
    """CREATE TABLE alerts (
        id {serial},
        received_at DOUBLE PRECISION NOT NULL,
        status TEXT NOT NULL,
        alertname TEXT NOT NULL,
        severity TEXT,
        target TEXT,
        instance TEXT,
        labels TEXT NOT NULL,
        annotations TEXT NOT NULL,
        starts_at DOUBLE PRECISION NOT NULL,
        ends_at DOUBLE PRECISION,
        fingerprint TEXT NOT NULL,
        UNIQUE (fingerprint, status, starts_at)
    )""",
    "CREATE INDEX alerts_by_time ON alerts (received_at)",
)
# What takes a store of the version before each one to that version, keeping its history.
MIGRATIONS = {
    2: ("ALTER TABLE rounds ADD COLUMN first_content_seconds REAL",),  # reasoning models' second TTFT
    3: ("ALTER TABLE sessions ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0",),  # cut by a stop
    4: (  # written round by round: the writer's id of a session, and whether it still runs
        "ALTER TABLE sessions ADD COLUMN uid TEXT",
        "CREATE UNIQUE INDEX sessions_by_uid ON sessions (uid)",
        "ALTER TABLE sessions ADD COLUMN in_flight INTEGER NOT NULL DEFAULT 0",
    ),
    5: ("ALTER TABLE sessions ADD COLUMN writer INTEGER",),  # which of several writers, to tell if it lives
    6: (  # what a session's stickiness was judged by (records.EVIDENCE), and its warm rounds' reuse
        "ALTER TABLE sessions ADD COLUMN evidence TEXT",
        "ALTER TABLE sessions ADD COLUMN warm_rounds INTEGER",
        "ALTER TABLE sessions ADD COLUMN warm_rounds_reused INTEGER",
        "ALTER TABLE sessions ADD COLUMN warm_cached_tokens INTEGER",
        "ALTER TABLE sessions ADD COLUMN warm_ideal_cached_tokens INTEGER",
        _EVIDENCE_OF_STORED_SESSIONS,
    ),
    7: ("ALTER TABLE rounds ADD COLUMN pin_outcome TEXT",),  # what a router said of the session's pin
    # A session's life (collectors.probe.lifecycle): its losses, its idle and what followed, its close.
    # Sessions stored before it said none of this: NULL, unknown.
    8: tuple(f"ALTER TABLE sessions ADD COLUMN {column} {kind}" for column, kind in LIFE_COLUMNS),
}

"""The probe's series, which serve/exporter.py serves per route: their names, help texts and labels, kept
with the collectors (as gatewaylogs/follower.py keeps the gateway logs') so that the config, below the
service, can keep a cluster label off every one of them (collectors/labels.py)."""

ROUTE_LABELS = ["target", "route_mode"]
COUNTERS = {
    # key: (name, help, extra labels)
    "sessions": ("kvwatch_probe_sessions", "Probe sessions by outcome.", ["outcome"]),
    "rounds": ("kvwatch_probe_rounds", "Successful probe rounds.", ["round"]),
    "errors": ("kvwatch_probe_errors", "Failed probe rounds by error kind.", ["kind"]),
    "prompt": ("kvwatch_probe_prompt_tokens", "Prompt tokens of successful probe rounds.", ["round"]),
    "cached": (
        "kvwatch_probe_cached_tokens",
        "Prompt tokens the engine reported as cached (usage.prompt_tokens_details.cached_tokens).",
        ["round"],
    ),
    # Every probe request the engines answered with a usage, failed rounds included: the engines counted
    # exactly these tokens for kvwatch's own traffic (prometheus/queries.py PROBE_SHARE, REAL_HIT_RATIO).
    "engine_prompt": (
        "kvwatch_probe_engine_prompt_tokens",
        "Prompt tokens the engines counted for probe requests (usage.prompt_tokens), failed rounds included.",
        [],
    ),
    "engine_cached": (
        "kvwatch_probe_engine_cached_tokens",
        "Cached prompt tokens the engines counted for probe requests "
        "(usage.prompt_tokens_details.cached_tokens), failed rounds included.",
        [],
    ),
    "unmetered": (
        "kvwatch_probe_unmetered_rounds",
        "Probe rounds the route answered without saying what the engine counted: no usage at all, or no "
        "cached tokens in it. Their tokens are in the engines' counters, not in kvwatch's.",
        ["missing"],
    ),
    "pins": (
        "kvwatch_probe_pin_outcome_rounds",
        "Probe rounds by the outcome of the session's pin that the router reported (olla's "
        "X-Olla-Sticky-Session: hit, miss, repin), beside kvwatch's own stickiness verdict.",
        ["outcome"],
    ),
    "ideal": (
        "kvwatch_probe_ideal_cached_tokens",
        "Prompt tokens a perfectly pinned replica would have cached: the previous round's prompt and "
        "answer, block-aligned.",
        ["round"],
    ),
    "stickiness": (
        "kvwatch_probe_stickiness_sessions",
        "Probe sessions by whether every round landed on one replica (unknown: no evidence).",
        ["sticky"],
    ),
    "evidence": (
        "kvwatch_probe_evidence_sessions",
        "Probe sessions by what their stickiness was judged by: the replica each round named, the warm "
        "rounds' reuse (cached against ideal tokens; SageMaker names no replica), or none.",
        ["evidence"],
    ),
    "losses": (
        "kvwatch_probe_session_losses",
        "Route sessions found gone before a round (SageMaker: expired, not_found, closed), each replaced "
        "by a new session.",
        ["kind"],
    ),
    "idle": (
        "kvwatch_probe_idle_sessions",
        "Probe sessions idled past the route's session TTL, by what followed (idled: all of them; expired: "
        "the route said the session was gone; cold: the next round paid a full prefill; new_replica: on "
        "another replica; repinned: the rounds after stayed with it).",
        ["outcome"],
    ),
    "close_checks": (
        "kvwatch_probe_close_checks",
        "Closed probe sessions checked afterwards, by whether the session was gone (false: the close left "
        "it alive).",
        ["gone"],
    ),
    "switches": ("kvwatch_probe_backend_switches", "Backend changes between consecutive rounds.", []),
    "echo": (
        "kvwatch_probe_session_id_echo_sessions",
        "Probe sessions by whether the gateway echoed the session id on every round.",
        ["echoed"],
    ),
    "backend": ("kvwatch_probe_backend_rounds", "Successful probe rounds per serving backend.", ["backend"]),
    "folded": (
        "kvwatch_probe_label_values_folded",
        'Probe rounds whose label value was shown as "other": beyond 32 values per route, or too long.',
        ["label", "reason"],
    ),
}

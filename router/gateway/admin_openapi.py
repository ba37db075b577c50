"""The OpenAPI 3.0 description of the admin API, built from code so it cannot drift from
``PolicyParams`` (each parameter's type comes from the dataclass). Served at ``/admin/openapi.json``;
``tests/router/test_admin_schema.py`` runs schemathesis against the live app with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from router.model import ReplicaStatus
from router.policy.params import PolicyParams

__all__ = ["openapi_spec"]

_ERR = {"$ref": "#/components/responses/Error"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _counts() -> dict[str, Any]:
    return {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}


def _params_schema() -> dict[str, Any]:
    props: dict[str, Any] = {}
    defaults = PolicyParams()
    for f in dataclasses.fields(PolicyParams):
        val = getattr(defaults, f.name)
        if isinstance(val, bool):
            props[f.name] = {"type": "boolean"}
        elif isinstance(val, int):
            props[f.name] = {"type": "integer"}
        elif isinstance(val, float):
            props[f.name] = {"type": "number"}
        else:
            props[f.name] = {"type": "string"}
        props[f.name]["default"] = val
    return {"type": "object", "properties": props, "additionalProperties": False}


def openapi_spec() -> dict[str, Any]:
    replica = {
        "type": "object",
        "required": [
            "id",
            "url",
            "status",
            "in_flight",
            "sessions_active",
            "kv_util",
            "running",
            "queued",
            "engine_cache_hit_rate",
            "affinity_breaks",
        ],
        "properties": {
            "id": {"type": "string"},
            "url": {"type": "string"},
            "status": {"type": "string", "enum": [s.value for s in ReplicaStatus]},
            "model": {"type": "string"},
            "dp_rank": _nullable(
                {"type": "integer", "minimum": 0, "description": "the data-parallel rank of its engine this replica is (null: the whole engine)"}
            ),
            "in_flight": {"type": "integer", "minimum": 0},
            "sessions_bound": _nullable(
                {"type": "integer", "minimum": 0, "description": "sessions homed here (counted up to 10000)"}
            ),
            "sessions_active": {"type": "integer", "minimum": 0},
            "active_context_tokens": {"type": "integer", "minimum": 0},
            "capacity_tokens": {"type": "integer", "minimum": 0},
            "host_capacity_tokens": {"type": "integer", "minimum": 0},
            "kv_util": {"type": "number", "minimum": 0},
            "running": {"type": "integer", "minimum": 0},
            "queued": {"type": "integer", "minimum": 0},
            "engine_cache_hit_rate": {"type": "number", "minimum": 0},
            "engine_age_s": _nullable({"type": "number", "minimum": 0}),
            "engine_reported_by": _nullable(
                {"type": "string", "description": "the gateway that scraped the engine figures (null: its sidecar, or none yet)"}
            ),
            "health_checked_by": _nullable(
                {"type": "string", "description": "who made the last good health check shared through the store"}
            ),
            "health_check_age_s": _nullable({"type": "number", "minimum": 0}),
            "tokens_written": {"type": "integer", "minimum": 0},
            "residency_horizon_tokens": {"type": "integer", "minimum": 0},
            "placed_recent": {"type": "integer", "minimum": 0},
            "affinity_breaks": {"type": "integer", "minimum": 0},
            "residency_source": {
                "type": "string",
                "enum": ["events", "estimate", "off"],
                "description": "exact residency from KV events: events (complete), estimate (subscribed, "
                "incomplete or disconnected), off (not followed)",
            },
        },
    }
    point = {
        "type": "object",
        "required": ["t", "dispersion", "chr", "in_flight", "requests"],
        "properties": {
            "t": {"type": "number"},
            "dispersion": {"type": "number", "minimum": 0},
            "chr": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
            "in_flight": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "requests": {"type": "integer", "minimum": 0},
        },
    }
    window_total = {
        "type": "object",
        "required": ["window", "total"],
        "properties": {"window": _counts(), "total": _counts()},
    }
    stats = {
        "type": "object",
        "required": ["now", "policy", "replicas", "fleet", "degradation", "series"],
        "properties": {
            "now": {"type": "number"},
            "policy": {"type": "string"},
            "policy_generation": {"type": "integer", "minimum": 0},
            "replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}},
            "fleet": {
                "type": "object",
                "required": [
                    "replicas",
                    "replicas_active",
                    "in_flight",
                    "dispersion_now",
                    "dispersion_window",
                    "chr_window",
                    "chr_total",
                    "decisions_by_reason",
                    "affinity_breaks_by_reason",
                    "residency_outcomes",
                    "load_histogram",
                    "window_s",
                ],
                "properties": {
                    "replicas": {"type": "integer", "minimum": 0},
                    "replicas_active": {"type": "integer", "minimum": 0},
                    "in_flight": {"type": "integer", "minimum": 0},
                    "sessions_active": {"type": "integer", "minimum": 0},
                    "load_histogram": _counts(),
                    "window_s": {"type": "number"},
                    "dispersion_now": {"type": "number", "minimum": 0},
                    "dispersion_window": {"type": "number", "minimum": 0},
                    "chr_window": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
                    "chr_total": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
                    "requests_window": {"type": "integer", "minimum": 0},
                    "requests_total": {"type": "integer", "minimum": 0},
                    "retries_total": {"type": "integer", "minimum": 0},
                    "decisions_by_reason": window_total,
                    "affinity_breaks_by_reason": window_total,
                    "residency_outcomes": window_total,
                    "requests_by_status": _counts(),
                },
            },
            "degradation": {
                "type": "object",
                "required": ["store_degraded", "replicas_down", "no_active_replicas", "panic"],
                "properties": {
                    "store_degraded": {"type": "boolean"},
                    "store_degraded_total": {"type": "integer", "minimum": 0},
                    "replicas_down": {"type": "integer", "minimum": 0},
                    "replicas_draining": {"type": "integer", "minimum": 0},
                    "no_active_replicas": {"type": "boolean"},
                    "panic": {"type": "boolean"},
                },
            },
            "series": {"type": "array", "items": point},
        },
    }
    session = {
        "type": "object",
        "required": [
            "session_id",
            "home",
            "overflow",
            "in_flight",
            "context_tokens",
            "last_seen_s_ago",
            "residency",
        ],
        "properties": {
            "session_id": {"type": "string"},
            "home": _nullable({"type": "string"}),
            "home_status": _nullable({"type": "string", "enum": [s.value for s in ReplicaStatus]}),
            "overflow": {"type": "array", "items": {"type": "string"}},
            "in_flight": _counts(),
            "in_flight_total": {"type": "integer", "minimum": 0},
            "context_tokens": {"type": "integer", "minimum": 0},
            "turns": {"type": "integer", "minimum": 0},
            "last_seen_s_ago": {"type": "number", "minimum": 0},
            "residency": {
                "type": "object",
                "required": ["estimate"],
                "properties": {
                    "estimate": {"type": "string", "enum": ["resident", "likely_evicted", "unknown"]},
                    "tokens_written_since": _nullable({"type": "integer", "minimum": 0}),
                    "capacity_tokens": _nullable({"type": "integer", "minimum": 0}),
                    "pressure": _nullable({"type": "number", "minimum": 0}),
                },
            },
            "resident_exact": {
                "type": "object",
                "required": ["home_tokens", "on"],
                "properties": {
                    "home_tokens": _nullable({"type": "integer", "minimum": 0}),
                    "on": _counts(),
                },
            },
        },
    }
    replica_in = {
        "type": "object",
        "required": ["url"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^[A-Za-z0-9_.:\[\]-]+$"},
            "url": {
                "type": "string",
                "maxLength": 2048,
                "description": "http(s) base URL; its address must be in the gateway's allowed networks "
                "(default loopback and private ranges), otherwise 400",
            },
            "model": {"type": "string", "maxLength": 256},
            "capacity_tokens": {"type": "integer", "minimum": 0, "maximum": 10**12},
            "host_capacity_tokens": {"type": "integer", "minimum": 0, "maximum": 10**12},
            "tp_size": {"type": "integer", "minimum": 0, "maximum": 10**12},
            "dp_rank": _nullable(
                {
                    "type": "integer", "minimum": 0, "maximum": 1023,
                    "description": "register one data-parallel rank of the engine at url as a replica of its own "
                    "(requests name it in X-Data-Parallel-Rank; default id host:port-dpN)",
                }
            ),
            "status": {"type": "string", "enum": [s.value for s in ReplicaStatus]},
        },
    }
    config = {
        "type": "object",
        "required": ["policy", "params", "generation", "shared_generation"],
        "properties": {
            "policy": {"type": "string"},
            "params": {"$ref": "#/components/schemas/PolicyParams"},
            "generation": {"type": "integer", "minimum": 0},
            "shared_generation": {
                "type": "integer",
                "minimum": 0,
                "description": "generation of the store's shared config this gateway routes with (0: none)",
            },
        },
    }
    config_patch = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "policy": {
                "type": "string",
                "enum": ["kv_aware", "random", "round_robin", "least_loaded", "hash"],
            },
            "params": {"$ref": "#/components/schemas/PolicyParams"},
        },
    }
    kv_events = {
        "type": "object",
        "required": ["mode"],
        "properties": {
            "mode": {"type": "string", "enum": ["off", "auto", "subscribe", "redis"]},
            "replicas": {"type": "object", "additionalProperties": {"type": "object"}},
            "subscribers": {"type": "object", "additionalProperties": {"type": "object"}},
            "writer": {"type": "object"},
            "mirror": {"type": "object"},
        },
    }
    rid_param = {
        "name": "replica_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^[A-Za-z0-9_.:\[\]-]+$"},
    }

    def ok(schema_ref: str, desc: str = "OK") -> dict[str, Any]:
        return {"description": desc, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}

    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvroute admin API",
            "version": "1.0.0",
            "description": "Operator surface of the kvroute gateway. Bearer-token auth (--admin-token / "
            "KVROUTE_ADMIN_TOKEN). Errors are OpenAI-style JSON.",
        },
        "security": [{"bearerAuth": []}],
        "paths": {
            "/admin/stats": {
                "get": {
                    "operationId": "getStats",
                    "summary": "Per-replica and fleet routing statistics",
                    "responses": {"200": ok("#/components/schemas/Stats"), "401": _ERR},
                }
            },
            "/admin/kv-events": {
                "get": {
                    "operationId": "getKvEvents",
                    "summary": "Exact residency: the mode, each replica's mirror (source, blocks, sessions, "
                    "events) and each subscriber's counters (syncs, rebuilds, gaps, replay failures, "
                    "connection)",
                    "responses": {"200": ok("#/components/schemas/KvEvents"), "401": _ERR},
                }
            },
            "/admin/replicas": {
                "get": {
                    "operationId": "listReplicas",
                    "summary": "Replicas known to the gateway",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["replicas"],
                                        "properties": {
                                            "replicas": {
                                                "type": "array",
                                                "items": {"$ref": "#/components/schemas/Replica"},
                                            }
                                        },
                                    }
                                }
                            },
                        },
                        "401": _ERR,
                    },
                },
                "post": {
                    "operationId": "upsertReplica",
                    "summary": "Register or update a replica (sidecars heartbeat through it without Redis)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ReplicaIn"}}
                        },
                    },
                    "responses": {
                        "200": ok("#/components/schemas/Replica", "Updated"),
                        "201": ok("#/components/schemas/Replica", "Created"),
                        "400": _ERR,
                        "401": _ERR,
                    },
                },
            },
            "/admin/replicas/{replica_id}/drain": {
                "post": {
                    "operationId": "drainReplica",
                    "summary": "Stop sending new sessions; sessions move at their next turn",
                    "parameters": [rid_param],
                    "responses": {
                        "200": ok("#/components/schemas/Replica"),
                        "400": _ERR,
                        "401": _ERR,
                        "404": _ERR,
                    },
                }
            },
            "/admin/replicas/{replica_id}": {
                "delete": {
                    "operationId": "deleteReplica",
                    "summary": "Forget a replica",
                    "parameters": [rid_param],
                    "responses": {
                        "200": {
                            "description": "Removed",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["id", "removed"],
                                        "properties": {
                                            "id": {"type": "string"},
                                            "removed": {"type": "boolean"},
                                        },
                                    }
                                }
                            },
                        },
                        "400": _ERR,
                        "401": _ERR,
                        "404": _ERR,
                    },
                }
            },
            "/admin/sessions/{session_id}": {
                "get": {
                    "operationId": "getSession",
                    "summary": "A session's routing state and cache residency estimate",
                    "parameters": [
                        {
                            "name": "session_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 256},
                        }
                    ],
                    "responses": {
                        "200": ok("#/components/schemas/Session"),
                        "400": _ERR,
                        "401": _ERR,
                        "404": _ERR,
                    },
                }
            },
            "/admin/config": {
                "get": {
                    "operationId": "getConfig",
                    "summary": "Policy name and parameters",
                    "responses": {"200": ok("#/components/schemas/Config"), "401": _ERR},
                },
                "patch": {
                    "operationId": "patchConfig",
                    "summary": "Change policy parameters (validated, applied to the next decision)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ConfigPatch"}}
                        },
                    },
                    "responses": {"200": ok("#/components/schemas/Config"), "400": _ERR, "401": _ERR},
                },
            },
            "/admin/openapi.json": {
                "get": {
                    "operationId": "getOpenApi",
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "401": _ERR,
                    },
                }
            },
            "/admin/ui": {
                "get": {
                    "operationId": "getDashboard",
                    "summary": "Live dashboard (HTML; polls /admin/stats)",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        },
                        "401": _ERR,
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Error": {
                    "description": "Error",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                }
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "code": {"type": "string"},
                            },
                        }
                    },
                },
                "Replica": replica,
                "ReplicaIn": replica_in,
                "Stats": stats,
                "KvEvents": kv_events,
                "Session": session,
                "Config": config,
                "ConfigPatch": config_patch,
                "PolicyParams": _params_schema(),
            },
        },
    }

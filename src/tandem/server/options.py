"""The server's limits and lifecycle settings (the `tandem serve` flags), in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = (
        None  # require "Authorization: Bearer <api_key>" (not on /health, /metrics)
    )
    max_request_bytes: int = 8 * 2**20  # a larger body is a 413
    max_sequences_per_request: int = 256  # prompts x n; more is a 400
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    health_stall_timeout_s: float = 60.0  # /health is 503 once work waits this long on no step
    drain_timeout_s: float = 30.0  # SIGTERM: open requests get this long before they are ended
    access_log: bool = False

    def validate(self) -> None:
        for name in ("max_request_bytes", "max_sequences_per_request", "max_stop_strings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_stop_string_length < 1:
            raise ValueError(
                f"max_stop_string_length must be at least 1, got {self.max_stop_string_length}"
            )
        for name in ("health_stall_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

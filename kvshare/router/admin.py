"""Who may change the router at run time: `POST /admin/policy` needs the token of `--admin-token-file`, sent as
`Authorization: Bearer TOKEN`; without that flag it is refused (403) for everyone. Safe by default: a router put on a
public address does not hand its placement to whoever finds it. Read-only endpoints (`/admin/state`, `/metrics`,
`/health`) stay open: they show replica URLs and health, no prompts."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import Response

from kvshare.router.proxy import error_response


@dataclass(frozen=True)
class AdminGate:
    token: bytes | None  # None: admin changes are off

    @classmethod
    def from_file(cls, path: str | None) -> "AdminGate":
        """The file's first line, stripped. Raises ValueError for an empty file (a blank token would admit anyone
        who sends 'Bearer ')."""
        if path is None:
            return cls(None)
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"admin token file {path} is empty: write a long random token in it")
        return cls(token.encode())

    def refusal(self, authorization: str | None) -> Response | None:
        """None when `authorization` carries the token (compared in constant time), else the response to send."""
        if self.token is None:
            return error_response(403, "admin changes are off on this router: start `kvshare route` with "
                                       "--admin-token-file FILE and send 'Authorization: Bearer <token>'",
                                  "permission_error", "admin_disabled")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
            response = error_response(401, "missing or wrong admin token: send 'Authorization: Bearer <token>' with "
                                           "the token of --admin-token-file", "authentication_error", "bad_token")
            response.headers["www-authenticate"] = "Bearer"
            return response
        return None

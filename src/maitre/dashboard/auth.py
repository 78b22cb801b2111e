"""Who may see the dashboard: the API's token, given once and kept in a cookie.

A browser cannot put a header on the page's own requests (an ``EventSource`` least of all), so the
dashboard takes the coordinator's token once, from its login form or from the URL ``maitre up``
prints (``/dashboard/?token=...``, which answers with the cookie and a redirect to the same page
without the token, so it stays out of the history), and keeps it in an ``HttpOnly``,
``SameSite=Strict`` cookie. The cookie opens reads only (``GET``): every action of the API still
needs the ``Authorization`` header, so no page of another site can act through a visitor's
cookie, and the dashboard offers no action.
"""

from __future__ import annotations

import hmac
from html import escape
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.responses import HTMLResponse, RedirectResponse, Response

COOKIE = "maitre_token"
PREFIX = "/dashboard"
LOGIN = PREFIX + "/login"
ICON = PREFIX + "/assets/favicon.svg"
"""Named by every page the dashboard serves, signed in or not: a page without an icon makes the
browser ask for ``/favicon.ico``, which, outside the dashboard, the API refuses (a 401 on the
login page's console)."""
LOGOUT = PREFIX + "/logout"
ASSETS = PREFIX + "/assets"
_READ = ("GET", "HEAD")


def _header(scope: dict[str, Any], name: bytes) -> bytes:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return b""


def _cookie(scope: dict[str, Any]) -> str:
    jar = SimpleCookie()
    try:
        jar.load(_header(scope, b"cookie").decode("latin-1"))
    except Exception:  # a malformed Cookie header is no token
        return ""
    morsel = jar.get(COOKIE)
    return morsel.value if morsel else ""


def same_token(given: str, token: str) -> bool:
    """``given`` is the token (compared in constant time; an empty one never is)."""
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def authorize(scope: dict[str, Any], token: str) -> tuple[bool, Response | None]:
    """``(True, None)``: let the request in. ``(False, response)``: answer it with that (a
    redirect to the login page, or one that sets the cookie). ``(False, None)``: not the
    dashboard's to answer: the API refuses it as it refuses any request without the token."""
    path, method = scope.get("path", ""), scope.get("method", "GET")
    if path == LOGIN or path.startswith(ASSETS + "/"):  # the assets hold no secret
        return True, None
    if same_token(_header(scope, b"authorization").decode("latin-1"), f"Bearer {token}"):
        return True, None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    on_page = path == PREFIX or path.startswith(PREFIX + "/")
    if on_page and method in _READ and "token" in query:
        if same_token(query["token"][-1], token):
            response = RedirectResponse(path if path != PREFIX else PREFIX + "/", 303)
            set_cookie(response, token, scope)
            return False, response
        return False, login_page("That token is not this coordinator's.", 401)
    if method in _READ and same_token(_cookie(scope), token):
        return True, None
    if on_page and method in _READ:
        return False, RedirectResponse(f"{LOGIN}?next={quote(path)}", 303)
    return False, None


def set_cookie(response: Response, token: str, scope: dict[str, Any]) -> None:
    response.set_cookie(
        COOKIE, token, httponly=True, samesite="strict", path="/", secure=scope.get("scheme") == "https"
    )


def parse_login(body: bytes) -> tuple[str, str]:
    """The login form's ``token`` and ``next`` (``next`` only if it is a dashboard page)."""
    form = parse_qs(body.decode("utf-8", "replace"))
    nxt = form.get("next", [PREFIX + "/"])[-1]
    if not nxt.startswith(PREFIX + "/") or "//" in nxt[1:] or "\\" in nxt:
        nxt = PREFIX + "/"
    return form.get("token", [""])[-1].strip(), nxt


def login_page(message: str = "", status: int = 200, nxt: str = PREFIX + "/") -> HTMLResponse:
    note = f'<p class="error" role="alert">{escape(message)}</p>' if message else ""
    return HTMLResponse(
        f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>maitre: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="{PREFIX}/assets/app.css">
<link rel="icon" href="{ICON}" type="image/svg+xml"></head>
<body class="login"><main><h1>maitre</h1>
<p>The dashboard needs the coordinator's token: the file <code>maitre up</code> wrote
(<code>--token-file</code>), or the URL it printed.</p>{note}
<form method="post" action="{LOGIN}"><input type="hidden" name="next" value="{escape(nxt)}">
<label>Token <input name="token" type="password" autocomplete="current-password" autofocus
required></label> <button type="submit">Sign in</button></form></main></body></html>""",
        status_code=status,
        headers={"Cache-Control": "no-store"},
    )

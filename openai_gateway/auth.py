"""Bearer tokens: the API key on inference routes, the admin token on adapter loading."""

import hmac

from fastapi import Request

from .errors import ApiError


def require_bearer(request: Request, token: str | None, what: str) -> None:
    """Nothing when `token` is None or the request carries it as `Authorization: Bearer <token>`
    (compared in constant time); 401 otherwise."""
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(
            401, f"No {what} was given: send `Authorization: Bearer <{what}>`.", code="invalid_api_key"
        )
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, f"Incorrect {what} provided.", code="invalid_api_key")

"""The remote client's one table from HTTP status to error (gateway.remote.status), and both of
the client's ways to the server answering by it."""

from __future__ import annotations

import pytest

from gateway.errors import AccessDenied, GatewayError, InvalidRequest, NamespaceChanged
from gateway.remote.status import STATUS_ERRORS, check, error_for
from gateway.remote.wire import RemoteUnavailable

EXPECTED: dict[int, type[GatewayError] | None] = {
    200: None, 201: None, 204: None,
    400: InvalidRequest, 401: AccessDenied, 403: AccessDenied, 413: InvalidRequest, 422: InvalidRequest,
    409: NamespaceChanged,
    404: RemoteUnavailable, 429: RemoteUnavailable,
    500: RemoteUnavailable, 502: RemoteUnavailable, 503: RemoteUnavailable, 504: RemoteUnavailable,
    301: RemoteUnavailable, 100: RemoteUnavailable,
}


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_each_status_is_its_rows_error(status: int) -> None:
    error = error_for(status, "POST /v1/lookup", "hashes: too many")
    want = EXPECTED[status]
    if want is None:
        assert error is None
        check(status, "POST /v1/lookup")  # raises nothing
        return
    assert type(error) is want
    if want is not AccessDenied:  # AccessDenied says only that (gateway.errors)
        assert str(error).startswith(f"POST /v1/lookup: {status}")
    with pytest.raises(want):
        check(status, "POST /v1/lookup")


def test_the_table_lists_only_the_callers_faults() -> None:
    assert set(STATUS_ERRORS) == {400, 401, 403, 409, 413, 422}
    assert all(400 <= s < 500 for s in STATUS_ERRORS)


def test_only_a_refused_fields_detail_is_kept_and_it_is_bounded() -> None:
    long = "x" * 1000
    assert str(error_for(422, "PUT /v1/chunks", long)) == "PUT /v1/chunks: 422 " + "x" * 200
    assert str(error_for(503, "PUT /v1/chunks", "the tier at redis://secret@host failed")) == "PUT /v1/chunks: 503"
    assert "denied" not in str(error_for(404, "PUT /v1/chunks", "denied"))

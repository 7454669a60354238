"""An obj tier's store asked once at startup with the tier's own credentials (connector/s3_probe.py): the signature
is AWS's (compared with botocore's signer), and each answer a store gives is judged as the module says, against a
local HTTP server that answers as S3 does."""

from __future__ import annotations

import datetime
import http.server
import logging
import threading

import pytest

from triton_offload.connector.s3_probe import Credentials, credentials_for, probe_store, sigv4_headers

NOW = datetime.datetime(2026, 11, 26, 12, 30, 45, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("token", ["", "session-token-1"], ids=["keys", "session"])
def test_the_signature_is_the_one_botocore_computes(token, monkeypatch):
    auth = pytest.importorskip("botocore.auth")
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    url = "http://127.0.0.1:9000/kvcache/__triton_offload_probe__/startup-check"
    ours = sigv4_headers("GET", url, "eu-west-1", Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI", token), NOW)
    request = AWSRequest(method="GET", url=url, headers={"x-amz-content-sha256": ours["x-amz-content-sha256"]})
    monkeypatch.setattr(auth, "get_current_datetime", lambda: NOW.replace(tzinfo=None))  # the same instant
    signer = S3SigV4Auth(BotoCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI", token or None), "s3", "eu-west-1")
    signer.add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]


def test_credentials_come_from_store_config_then_the_environment():
    keys = {"access_key": "a", "secret_key": "b", "region": "r"}
    assert credentials_for(keys, {}) == Credentials("a", "b")
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_SESSION_TOKEN": "z"}
    assert credentials_for({}, env) == Credentials("x", "y", "z", "environment")
    assert credentials_for({}, {"AWS_PROFILE": "prod"}) == "AWS_PROFILE"
    assert "b" not in repr(credentials_for(keys, {})), "the secret is never printed"


class _S3:
    """A local HTTP server answering every GET with one status and S3 error code, recording the requests."""

    def __init__(self, status: int, code: str = ""):
        seen = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                seen.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
                body = f"<Error><Code>{code}</Code><Message>from the test</Message></Error>".encode() if code else b""
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


KEYS = {"bucket": "kvcache", "access_key": "AKID1", "secret_key": "secret1", "region": "us-east-1"}


@pytest.fixture
def no_aws_env(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials


def test_a_missing_object_is_a_store_that_lets_us_in(no_aws_env):
    with _S3(404, "NoSuchKey") as s3:
        probe_store("tier", s3.url, KEYS)
    (request,) = s3.requests
    assert request["path"] == "/kvcache/__triton_offload_probe__/startup-check"
    assert request["headers"]["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKID1/")


def test_a_refused_signed_request_is_a_credentials_problem_naming_the_endpoint(no_aws_env):
    with _S3(403, "InvalidAccessKeyId") as s3, pytest.raises(PermissionError) as info:
        probe_store("kv_connector_extra_config['secondary_tiers'][0]", s3.url, KEYS)
    text = str(info.value)
    assert f"[0]: the object store at {s3.url} refused the credentials for bucket 'kvcache'" in text
    assert "(HTTP 403 InvalidAccessKeyId: from the test): a credentials problem" in text
    assert "Access key 'AKID1' from store_config" in text and "secret1" not in text


def test_a_missing_bucket_is_named(no_aws_env):
    with _S3(404, "NoSuchBucket") as s3, pytest.raises(ValueError, match="has no bucket 'kvcache'"):
        probe_store("tier", s3.url, KEYS)


def test_no_credentials_is_warned_of_and_an_anonymous_refusal_only_warns(no_aws_env, caplog):
    with caplog.at_level(logging.WARNING, logger="triton_offload.connector.s3_probe"), _S3(403, "AccessDenied") as s3:
        probe_store("tier", s3.url, {"bucket": "kvcache"})
    assert "no credentials for the object store" in caplog.text and "Set store_config's access_key" in caplog.text
    assert "refused an anonymous request (HTTP 403 AccessDenied" in caplog.text
    assert "authorization" not in s3.requests[0]["headers"], "anonymous, as NIXL would send it"


def test_credentials_from_another_source_are_left_to_vllm(no_aws_env, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "prod")
    with _S3(403, "AccessDenied") as s3:
        probe_store("tier", s3.url, {"bucket": "kvcache"})
    assert s3.requests == [], "the probe cannot sign as the SDK will with a profile: it asks nothing"


def test_the_environments_keys_sign_when_store_config_has_none(no_aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secretenv")
    with _S3(403, "SignatureDoesNotMatch") as s3, pytest.raises(PermissionError, match="'AKIDENV' from environment"):
        probe_store("tier", s3.url, {"bucket": "kvcache"})

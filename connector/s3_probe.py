"""An ``obj`` tier's object store asked once, at startup, with the tier's own credentials: does it let us in
(:func:`probe_store`)? vLLM's obj tier (NIXL's OBJ plugin, the AWS SDK) reports a store that refuses its credentials
only per request, later, as ``NIXL_ERR_BACKEND`` / "HeadObject requests failed", and a bucket that does not exist not at
all. Here, one ``GET`` of an object that does not exist, signed with AWS Signature Version 4 (stdlib only: no boto3 in
vLLM's environment), tells them apart before the tier is built: ``404 NoSuchKey`` is a store that lets us in; ``403`` is
a credentials problem (the keys are refused, or lack ``s3:GetObject`` / ``s3:ListBucket`` on the bucket, which the
tier's lookups need too); ``404 NoSuchBucket`` is a bucket to create. Requests go path-style
(``scheme://endpoint/bucket/key``), as S3-compatible stores (MinIO, Ceph, moto) take them; the credentials are those
NIXL will use (:func:`credentials_for`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

__all__ = ["Credentials", "credentials_for", "sigv4_headers", "probe_store", "PROBE_KEY"]

logger = logging.getLogger(__name__)

PROBE_KEY = "__triton_offload_probe__/startup-check"  # never written: the answer for a missing object is the point
PROBE_TIMEOUT_S = 10.0
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# Sources of the AWS SDK's default credential chain this probe cannot sign with itself.
_OTHER_SOURCES = (
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass(frozen=True)
class Credentials:
    """The keys a request is signed with, and where they came from (for messages: never the secret)."""

    access_key: str
    secret_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)
    source: str = "store_config"


def credentials_for(store_config: dict, environ: dict | None = None) -> Credentials | str | None:
    """The credentials NIXL's OBJ plugin will use for ``store_config``: :class:`Credentials` where this probe can sign
    with them, the name of another source of the AWS SDK's chain where it cannot (a string), or None for none at all
    (anonymous requests).

    Credentials are those NIXL will use: ``store_config``'s ``access_key`` / ``secret_key`` (and ``session_token``),
    else the environment's ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``). Where they come
    from another source of the AWS SDK's default chain (a profile or credentials file, web identity, a container or
    instance role), this probe cannot sign as the SDK will, and leaves the store to vLLM's own probe.
    """
    env = os.environ if environ is None else environ
    if store_config.get("access_key") and store_config.get("secret_key"):
        return Credentials(
            store_config["access_key"], store_config["secret_key"], store_config.get("session_token", "")
        )
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return Credentials(
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN", ""), "environment"
        )
    for name in _OTHER_SOURCES:
        if env.get(name):
            return name
    home_file = os.path.join(os.path.expanduser("~"), ".aws", "credentials")
    return home_file if os.path.exists(home_file) else None


def sigv4_headers(method: str, url: str, region: str, creds: Credentials, now: datetime.datetime) -> dict[str, str]:
    """The headers that sign an S3 request without a body (AWS Signature Version 4, service ``s3``): ``Host``,
    ``x-amz-date``, ``x-amz-content-sha256`` (of the empty body), ``x-amz-security-token`` with a session token, and
    ``Authorization``. ``url``'s path must be percent-encoded already (it is signed as it is sent)."""
    parts = urllib.parse.urlsplit(url)
    amz_date = now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": parts.netloc, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz_date}
    if creds.session_token:
        headers["x-amz-security-token"] = creds.session_token
    names = sorted(headers)
    query = "&".join(sorted(parts.query.split("&"))) if parts.query else ""
    canonical = "\n".join(
        [method, parts.path or "/", query, *(f"{n}:{headers[n]}" for n in names), "", ";".join(names), _EMPTY_SHA256]
    )
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + creds.secret_key).encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, SignedHeaders={';'.join(names)}, "
        f"Signature={signature}"
    )
    return headers


def _s3_error(body: bytes) -> tuple[str, str]:
    text = body.decode(errors="replace")
    code = re.search(r"<Code>([^<]*)</Code>", text)
    message = re.search(r"<Message>([^<]*)</Message>", text)
    return (code.group(1) if code else "", message.group(1) if message else "")


def probe_store(where: str, url: str, store_config: dict, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Asks the store at ``url`` (``scheme://endpoint``) for a missing object of ``store_config['bucket']`` with the
    tier's credentials, and judges the answer (module docstring). With no credentials at all the tier runs
    anonymously: that is warned of, and an anonymous refusal is a warning too (an instance role, which the probe cannot
    see, may still let NIXL in).

    Raises:
        PermissionError: a signed request refused (HTTP 403): a credentials problem, naming the tier, the endpoint,
            the bucket, the access key id and where it came from, and the store's error code.
        ValueError: the bucket does not exist (404 NoSuchBucket), or another refusal of a signed request (4xx),
            naming the tier, the endpoint and the store's answer.
    """
    bucket = store_config["bucket"]
    creds = credentials_for(store_config)
    if isinstance(creds, str):
        logger.info(
            "%s: credentials come from the AWS SDK's default chain (%s): the store at %s is left to vLLM's probe",
            where,
            creds,
            url,
        )
        return
    if creds is None:
        logger.warning(
            "%s: no credentials for the object store at %s (no access_key/secret_key in store_config, no "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, no AWS profile or credentials file): NIXL will send anonymous "
            "requests, which most stores refuse (HTTP 403) or which write objects other instances cannot read. Set "
            "store_config's access_key, secret_key and region (docs/tiering.md, 'obj')",
            where,
            url,
        )
    target = f"{url.rstrip('/')}/{urllib.parse.quote(bucket)}/{urllib.parse.quote(PROBE_KEY)}"
    headers = {}
    if isinstance(creds, Credentials):
        region = store_config.get("region") or "us-east-1"
        headers = sigv4_headers("GET", target, region, creds, datetime.datetime.now(datetime.timezone.utc))
        headers.pop("host")  # urllib sends the same Host itself
    context = None
    if target.startswith("https:"):
        context = ssl.create_default_context(cafile=store_config.get("ca_bundle") or None)
    request = urllib.request.Request(target, headers=headers, method="GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=timeout_s):
            return  # someone stored an object under our probe's name: the store lets us in all the same
    except urllib.error.HTTPError as e:
        status, (code, message) = e.code, _s3_error(e.read())
    except (OSError, ValueError) as e:  # TLS, a reset connection, a timeout: vLLM's own probe will say more
        logger.warning("%s: the object store at %s did not answer a test request (%s); left to vLLM", where, url, e)
        return
    answer = f"HTTP {status}" + (f" {code}" if code else "") + (f": {message}" if message else "")
    if status == 404 and code != "NoSuchBucket":
        return  # NoSuchKey: in, and the object is missing, as it should be
    if status == 404:
        raise ValueError(
            f"{where}: the object store at {url} has no bucket {bucket!r} ({answer}). Create it (the tier does not), "
            "or fix store_config's bucket"
        )
    if creds is None:
        logger.warning("%s: the object store at %s refused an anonymous request (%s)", where, url, answer)
        return
    if status == 403:
        raise PermissionError(
            f"{where}: the object store at {url} refused the credentials for bucket {bucket!r} ({answer}): a "
            f"credentials problem. Access key {creds.access_key!r} from {creds.source}: check store_config's "
            "access_key, secret_key, session_token and region, and that they may get and list objects in the bucket"
        )
    if status >= 500 or status in (301, 307):  # a busy store, or one that wants another region or host: vLLM's to tell
        logger.warning("%s: the object store at %s answered a test request with %s; left to vLLM", where, url, answer)
        return
    raise ValueError(f"{where}: the object store at {url} refused a test request for bucket {bucket!r} ({answer})")

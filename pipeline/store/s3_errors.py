"""Every failure of the AWS SDK as a pipeline error (``translate_error``), credentials
scrubbed from the message: the one place both S3 paths, botocore's and the lean ranged GETs
(``pipeline.store.s3_ranges``), and the KMS signer turn SDK errors into exit codes."""

from __future__ import annotations

import sys

from botocore.exceptions import (
    ClientError,
    ConnectionError,
    HTTPClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)

from pipeline.errors import (
    AlreadyExistsError,
    ConflictError,
    InputError,
    NotFoundError,
    PipelineError,
    StoreError,
)
from pipeline.store._redact import scrub


def upload_failed(e: BaseException) -> bool:
    # boto3 is imported by managed transfers only; no boto3, no boto3 error
    exceptions = sys.modules.get("boto3.exceptions")
    return exceptions is not None and isinstance(e, exceptions.S3UploadFailedError)


def translate_error(e: BaseException, what: str, *, condition: str | None = None) -> PipelineError:
    """Every boto3 failure becomes a pipeline error here, and only here.

    ``condition``: "if_absent" or "if_match" when the request was a conditional write, so
    that 412 Precondition Failed means AlreadyExists or Conflict respectively.
    """
    if upload_failed(e) and isinstance(e.__context__, ClientError):
        e = e.__context__  # boto3 wraps upload errors in a string; the real one is the context
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = scrub(str(err.get("Message") or code or "error"))
        if code == "NoSuchBucket":
            bucket = what.split("/")[2] if what.startswith("s3://") else what
            return NotFoundError(f"s3://{bucket}", "bucket does not exist", "check --store")
        if code in ("404", "NoSuchKey", "NotFound") or status == 404:
            return NotFoundError(what, "not found in the store", None)
        if code == "PreconditionFailed" or status == 412:
            if condition == "if_absent":
                return AlreadyExistsError(what, "already exists", None)
            return ConflictError(what, "changed since it was read", "re-read and retry")
        if code == "ConditionalRequestConflict" or status == 409:
            return ConflictError(what, "a concurrent conditional write won", "retry")
        if status == 403 or code in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
        ):
            return StoreError(
                what,
                f"access denied ({code}: {message})",
                "check the AWS credentials (AWS_PROFILE, the IRSA role) and the bucket policy",
            )
        return StoreError(what, f"S3 error {code or status}: {message}", "retry later")
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StoreError(
            what,
            "no usable AWS credentials",
            "set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use an IRSA role",
        )
    if isinstance(e, ParamValidationError):  # refused before any request: retrying can't help
        report = str(e.kwargs.get("report") or e).strip().splitlines()
        return InputError(what, scrub(report[0] if report else str(e)), "check --store")
    if isinstance(e, ConnectionError | HTTPClientError):
        return StoreError(
            what, f"cannot reach S3: {scrub(str(e))}", "check the network and AWS_ENDPOINT_URL"
        )
    return StoreError(what, scrub(str(e)) or type(e).__name__, None)

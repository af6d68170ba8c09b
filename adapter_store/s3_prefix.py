"""S3Prefix: the place under s3://bucket/prefix where stores share their catalog and blobs, and
the few calls they make there, conditional writes included.

A conditional write that loses (412 PreconditionFailed; 409 ConditionalRequestConflict, which S3
answers while another conditional write to the key is in flight; 404 for If-Match on a key that
is gone) is an answer, not an error: put and delete return None / False and the caller re-reads.
Every other failure is UNAVAILABLE naming the location and what S3 said: the store cannot reach
its catalog, whatever the request was.
"""

from collections.abc import Callable
from typing import TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from shared.errors import Unavailable

_LOST = (404, 409, 412)  # HTTP statuses of a conditional write that did not happen
T = TypeVar("T")


class S3Prefix:
    def __init__(self, uri: str, client):
        """`uri` is s3://bucket/prefix (StoreConfig checked it); `client` a boto3 S3 client
        (thread-safe)."""
        self.bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self._prefix = prefix.strip("/")
        self.uri = f"s3://{self.bucket}/{self._prefix}".rstrip("/")
        self._client = client

    def get(self, path: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag; None when there is none."""
        return self._call(path, lambda: self._read(path), quiet=(404,))

    def exists(self, path: str) -> bool:
        head = self._call(
            path, lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(path)), (404,)
        )
        return head is not None

    def put(
        self, path: str, body: bytes, if_none_match: bool = False, if_match: str | None = None
    ) -> str | None:
        """The new ETag; None when the condition did not hold. `if_none_match`: only create;
        `if_match`: only replace the version with that ETag."""
        conditions = {"IfNoneMatch": "*"} if if_none_match else {}
        if if_match is not None:
            conditions["IfMatch"] = if_match
        request = dict(Bucket=self.bucket, Key=self._key(path), Body=body, **conditions)
        response = self._call(path, lambda: self._client.put_object(**request), _LOST if conditions else ())
        return None if response is None else response["ETag"]

    def delete(self, path: str, if_match: str) -> bool:
        """False when the object is no longer the version with ETag `if_match` (or is gone)."""
        request = dict(Bucket=self.bucket, Key=self._key(path), IfMatch=if_match)
        return self._call(path, lambda: self._client.delete_object(**request), _LOST) is not None

    def list(self, folder: str) -> dict[str, str]:
        """Name under `folder` -> ETag, for every object there."""
        folder = folder.rstrip("/") + "/"
        return self._call(folder, lambda: self._list(self._key(folder)))

    def _key(self, path: str) -> str:
        return f"{self._prefix}/{path}" if self._prefix else path

    def _read(self, path: str) -> tuple[bytes, str]:
        response = self._client.get_object(Bucket=self.bucket, Key=self._key(path))
        with response["Body"] as body:
            return body.read(), response["ETag"]

    def _list(self, start: str) -> dict[str, str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
        return {
            obj["Key"].removeprefix(start): obj["ETag"] for page in pages for obj in page.get("Contents", ())
        }

    def _call(self, path: str, fn: Callable[[], T], quiet: tuple[int, ...] = ()) -> T | None:
        """fn(); None when S3 answers with an HTTP status in `quiet`, UNAVAILABLE for any other
        failure."""
        try:
            return fn()
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status in quiet:
                return None
            raise self._unavailable(path, _said(e, status)) from None
        except BotoCoreError as e:  # connection refused or reset, timeouts, no credentials
            raise self._unavailable(path, str(e)) from None

    def _unavailable(self, path: str, said: str) -> Unavailable:
        endpoint = self._client.meta.endpoint_url
        return Unavailable(f"shared catalog {self.uri}: S3 endpoint {endpoint} failed on {path} ({said})")


def _said(e: ClientError, status: int) -> str:
    error = e.response.get("Error", {})
    return f"{error.get('Code') or status}: {error.get('Message', '')}".rstrip(": ")

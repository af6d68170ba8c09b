"""S3Source: a checkpoint under s3://bucket/prefix, in a bucket this store is allowed to read.

Needs s3:ListBucket (one listing learns which files exist and their sizes, and tells a missing
bucket from a missing file) and s3:GetObject. Credentials come from the environment, as boto3
finds them by default; the endpoint only from the store's config, never from a request."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

from adapter_store.config import StoreConfig
from shared import peft_vocab
from shared.errors import InvalidArgument, LoramuxError, NotFound, PermissionDenied, Unavailable


class S3Source:
    def __init__(self, uri: str, config: StoreConfig, where: str, client: Callable[[], object]):
        """`client` gives the store's one S3 client (thread-safe, slow to build)."""
        self._where = where
        self._bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/")
        self._key_prefix = f"{prefix}/" if prefix else ""
        self.uri = f"s3://{self._bucket}/{prefix}".rstrip("/")
        if not self._bucket:
            raise InvalidArgument(f"{where}: {uri!r} names no bucket; use s3://bucket/prefix")
        # Checked before the client exists: a refused bucket costs no network call.
        if self._bucket not in config.s3_allowed_buckets:
            allowed = ", ".join(config.s3_allowed_buckets) or "none configured"
            raise PermissionDenied(
                f"{where}: bucket {self._bucket!r} is not one of the allowed buckets ({allowed})"
            )
        self._client = client()
        self._endpoint = self._client.meta.endpoint_url
        self._sizes = self._list_sizes()

    def size(self, name: str) -> int | None:
        return self._sizes.get(name)

    @contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        with self._errors(f"{self.uri}/{name}"):
            body = self._client.get_object(Bucket=self._bucket, Key=self._key_prefix + name)["Body"]
            # The caller reads inside this block, so a connection lost mid-file is mapped too.
            with body:
                yield body

    def _list_sizes(self) -> dict[str, int]:
        """Checkpoint file name -> bytes, for the objects directly under the prefix that a
        checkpoint's files are named like (the adapter's, and PEFT's old file of added tokens,
        which is refused by name)."""
        sizes = {}
        with self._errors(self.uri):
            for start in ("adapter_", peft_vocab.NEW_EMBEDDINGS_FILE):
                pages = self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self._bucket, Prefix=self._key_prefix + start, Delimiter="/"
                )
                sizes |= {
                    obj["Key"].removeprefix(self._key_prefix): obj["Size"]
                    for page in pages
                    for obj in page.get("Contents", ())
                }
        return sizes

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except ClientError as e:
            raise self._refusal(e, what) from None
        except ParamValidationError as e:
            raise InvalidArgument(f"{self._where}: {self.uri} is not a valid S3 location ({e})") from None
        except BotoCoreError as e:  # connection refused or reset, timeouts, no credentials
            raise Unavailable(f"{self._where}: S3 endpoint {self._endpoint} is unavailable ({e})") from None

    def _refusal(self, e: ClientError, what: str) -> LoramuxError:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        said = f"S3 at {self._endpoint} answered {code or status}"
        if code == "NoSuchBucket":
            return NotFound(f"{self._where}: bucket {self._bucket!r} does not exist ({said})")
        if status == 404:
            return NotFound(f"{self._where}: {what} does not exist ({said})")
        if status in (401, 403):
            return PermissionDenied(f"{self._where}: access to {what} was denied ({said})")
        if status >= 500:
            return Unavailable(f"{self._where}: reading {what} failed ({said})")
        return InvalidArgument(f"{self._where}: reading {what} failed ({said}: {e})")


def s3_client(config: StoreConfig):
    # A session of its own: boto3's shared default session is not safe to use from many threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.s3_endpoint,
        config=Config(
            retries={"mode": "standard", "max_attempts": 5},
            connect_timeout=config.s3_timeout_s,
            read_timeout=config.s3_timeout_s,
        ),
    )

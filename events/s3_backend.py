"""The S3 backend of artifact storage, imported only when storage is first used (:func:`events.storage.get_storage`).

boto3 and botocore take about half a second to import; every daemon, web worker and management
command imports the storage module (through the admin and retention), and most never touch S3.
"""

from __future__ import annotations

from typing import Any

from storages.backends.s3 import S3Storage


class ArtifactStorage(S3Storage):
    """S3Storage that stores bytes exactly as given."""

    def _get_write_parameters(self, name: str, content: Any = None) -> dict[str, Any]:
        params = super()._get_write_parameters(name, content)
        # mimetypes marks "x.tar.gz" as Content-Encoding gzip; HTTP clients would then unzip it on
        # download and the bytes would no longer match the recorded checksum.
        params.pop("ContentEncoding", None)
        return params


__all__ = ["ArtifactStorage"]

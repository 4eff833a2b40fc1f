"""S3Tier on a real moto server: the contract, outages, credentials, storage classes."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.errors import ConfigError, StorageError
from ckptstore.storage import S3Tier, is_retryable
from ckptstore.testing.s3 import FAKE_ACCESS_KEY_ID, MotoS3
from ckptstore.testing.tiers import BackendTests

pytestmark = pytest.mark.s3


class TestS3Tier(BackendTests):
    @pytest.fixture
    def tier(self, moto_s3: MotoS3) -> S3Tier:
        return S3Tier(moto_s3.url("warm"), moto_s3.storage_options, name="warm")

    @pytest.fixture
    def tier_twin(self, moto_s3: MotoS3) -> S3Tier:
        return S3Tier(moto_s3.url("warm"), moto_s3.storage_options, name="warm")


def test_url_has_no_endpoint_or_credentials(moto_s3: MotoS3) -> None:
    tier = S3Tier(moto_s3.url("a/b"), moto_s3.storage_options, name="warm")
    assert tier.url == f"s3://{moto_s3.bucket}/a/b"
    assert tier.uri_for("run", "abc") == f"s3://{moto_s3.bucket}/a/b/run/abc"
    assert tier.local_dir("run", "abc") is None
    assert tier.free_bytes() is None


@pytest.mark.parametrize(
    "options",
    [{"secret": "x"}, {"key": "AKIA"}, {"client_kwargs": {"aws_secret_access_key": "x"}},
     {"token": "t"}],
)
def test_credentials_in_options_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="credential"):
        S3Tier("s3://bucket/p", options)


def test_transport_checksums_are_left_to_the_stores_own_digests(moto_s3: MotoS3) -> None:
    # botocore's CRC32 of every body costs CPU the store's crc32c / blake3 checks make
    # redundant; a caller's own client settings are kept, this one included.
    plain = S3Tier(moto_s3.url("p"), moto_s3.storage_options)
    assert plain.fs.config_kwargs["response_checksum_validation"] == "when_required"
    assert plain.fs.config_kwargs["request_checksum_calculation"] == "when_required"
    plain.put_bytes("k", b"x" * 100)
    assert plain.get_bytes("k") == b"x" * 100
    own = {**moto_s3.storage_options,
           "config_kwargs": {"retries": {"max_attempts": 1},
                             "response_checksum_validation": "when_supported"}}
    tier = S3Tier(moto_s3.url("p"), own)
    assert tier.fs.config_kwargs["retries"] == {"max_attempts": 1}
    assert tier.fs.config_kwargs["response_checksum_validation"] == "when_supported"
    assert tier.get_bytes("k") == b"x" * 100


def test_tiers_share_botocores_parsed_models_and_nothing_else(
        moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each tier's first request used to parse botocore's S3 model and endpoint data again
    # (about 60 ms of CPU): the files are read once per process, through one loader.
    first = S3Tier(moto_s3.url("a"), moto_s3.storage_options)
    first.put_bytes("k", b"a")
    models = first.fs.session.get_component("data_loader")
    # A second tier, made after the credentials in the environment changed: its own
    # session, which resolves them anew (moto refuses no key, the session shows what it used).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key-id")
    second = S3Tier(moto_s3.url("b"), moto_s3.storage_options)
    second.put_bytes("k", b"b")
    assert second.fs.session is not first.fs.session
    assert second.fs.session.get_component("data_loader") is models
    keys = [asyncio.run(t.fs.session.get_credentials()).access_key for t in (first, second)]
    assert keys == [FAKE_ACCESS_KEY_ID, "another-key-id"]
    assert (first.get_bytes("k"), second.get_bytes("k")) == (b"a", b"b")


@pytest.mark.parametrize("url", ["s3://", "s3:///x", "s3://b/a/../c", "http://b/x"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        S3Tier(url, {})


def test_storage_class_is_applied(moto_s3: MotoS3) -> None:
    tier = S3Tier(moto_s3.url("ia"), moto_s3.storage_options, storage_class="standard_ia",
                  name="cold")
    tier.put_bytes("run/abc/f", b"x")
    head = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key="ia/run/abc/f")
    assert head["StorageClass"] == "STANDARD_IA"
    assert tier.readable


def test_glacier_read_gives_actionable_error(moto_s3: MotoS3) -> None:
    tier = S3Tier(moto_s3.url("glacier"), moto_s3.storage_options, storage_class="GLACIER",
                  name="cold")
    assert not tier.readable
    tier.put_bytes("run/abc/f", b"xyz")
    tier.put_bytes("run/abc/manifest.json", b"{}")
    assert tier.size("run/abc/f") == 3
    with pytest.raises(StorageError, match="restore"):
        tier.get_bytes("run/abc/f")
    # The manifest stays readable (default storage class) for verify and retention.
    assert tier.get_bytes("run/abc/manifest.json") == b"{}"


def test_missing_bucket(moto_s3: MotoS3) -> None:
    tier = S3Tier("s3://no-such-bucket-ckpt/x", moto_s3.storage_options, name="warm")
    with pytest.raises(StorageError) as info:
        tier.put_bytes("run/abc/f", b"x")
    assert "no-such-bucket-ckpt" in str(info.value)


def test_abort_multipart_uploads(moto_s3: MotoS3) -> None:
    client = moto_s3.client()
    for key in ("mpu/run/abc/big", "mpu/run/abc/big2", "mpu/run/other/big"):
        client.create_multipart_upload(Bucket=moto_s3.bucket, Key=key)
    tier = S3Tier(moto_s3.url("mpu"), moto_s3.storage_options, name="warm")
    assert tier.abort_multipart_uploads("run/abc/") == 2
    assert tier.abort_multipart_uploads("run/abc/") == 0
    assert tier.abort_multipart_uploads("run/") == 1


@pytest.fixture
def outage_s3() -> Iterator[MotoS3]:
    """A private server that tests may stop and start."""
    with MotoS3() as s3:
        yield s3


def test_outage_is_retryable_storage_error_and_recovers(outage_s3: MotoS3) -> None:
    tier = S3Tier(outage_s3.url("w"), outage_s3.storage_options, name="warm")
    tier.put_bytes("run/abc/f", b"before")
    outage_s3.stop()
    try:
        with pytest.raises(StorageError) as info:
            tier.get_bytes("run/abc/f")
        assert is_retryable(info.value)
        assert "unreachable" in str(info.value)
        assert "warm tier" in str(info.value)
        with pytest.raises(StorageError):
            tier.put_bytes("run/abc/g", b"x")
        with pytest.raises(StorageError):
            tier.list_prefix("run/")
    finally:
        outage_s3.start()
    assert tier.get_bytes("run/abc/f") == b"before"


def test_credentials_never_in_errors_or_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "SECRET-MARKER-a8f3e1c9d2"
    key_id = "AKIDMARKER77"
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    with MotoS3(access_key_id=key_id, secret_access_key=secret) as s3:
        good = S3Tier(s3.url("w"), s3.storage_options, name="warm")
        good.put_bytes("run/abc/f", b"x")
        glacier = S3Tier(s3.url("g"), s3.storage_options, storage_class="GLACIER", name="cold")
        glacier.put_bytes("run/abc/f", b"x")
        # A missing bucket (404) and a read denied with 403 (InvalidObjectState on a GLACIER
        # object): both must name the tier but never the secret.
        for tier, key in ((S3Tier("s3://missing-bucket-ckpt/w", s3.storage_options,
                                  name="warm"), "run/abc/nope"),
                          (glacier, "run/abc/f")):
            try:
                tier.get_bytes(key)
            except StorageError as exc:
                texts.append(str(exc))
                texts.append("".join(traceback.format_exception(exc)))
        s3.stop()
        try:
            good.get_bytes("run/abc/f")
        except StorageError as exc:
            texts.append(str(exc))
            texts.append("".join(traceback.format_exception(exc)))
    assert len(texts) == 6
    everything = "\n".join(texts) + "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in everything
    ours = "\n".join(texts[::2]) + "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith("ckptstore")
    )
    assert key_id not in ours


def test_scrub_removes_env_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.storage import scrub_secrets

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    text = scrub_secrets("boom hunter2-secret at http://h:1 key=abcd1234",
                         {"endpoint_url": "http://h:1", "nested": {"secret": "abcd1234"}})
    assert text == "boom *** at http://h:1 key=***"

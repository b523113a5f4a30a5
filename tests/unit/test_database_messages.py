"""Connection errors never show the password, even one libpq reads partly as the host, port or
database because a character in it is not percent-encoded."""

import re

import pytest

from kafka2pg.database import connect, describe
from kafka2pg.exceptions import ConfigError, DatabaseRefusedError, DatabaseUnavailableError

PASSWORDS = [
    "S3cr/etXy",
    "S3cret@Passw0rd",
    "Pa55word?x=1",
    "Pa55#word",
    "Pa55:w0rd/sl@sh",
    "Pa55@Zq9v:2024#x",  # libpq: host "Zq9v", port "2024#x@127.0.0.1:9"
    "Adm1n@prod#2024:x",
    "S3cr3t@PW",  # a 2-character rest: no part of a misread URL is shown, however short
]


@pytest.mark.parametrize("password", PASSWORDS)
def test_no_part_of_a_password_typed_unencoded_in_a_url_is_in_the_error_or_the_description(password):
    url = f"postgresql://k2p_owner:{password}@127.0.0.1:9/kafka2pg"
    with pytest.raises((DatabaseUnavailableError, DatabaseRefusedError, ConfigError)) as failed:
        connect(url, connect_timeout=2)
    shown = f"{failed.value} {describe(url)}"
    parts = [password, *(p for p in re.split(r"[/@?#:]", password) if len(p) >= 3)]
    assert not [part for part in parts if part in shown], shown
    assert failed.value.__cause__ is None and failed.value.__context__ is None or failed.value.__suppress_context__
    if "@" in password or "/" in password:  # misread: nothing libpq took for the host, port or database
        assert describe(url) == "(a URL whose password libpq misreads)"
        assert isinstance(failed.value, ConfigError) and "percent-encode / @ ? # :" in str(failed.value)
        assert "PW" not in shown.replace("PostgreSQL", "")


def test_a_space_in_a_url_is_named_as_a_space_without_quoting_the_url():
    with pytest.raises(ConfigError) as failed:
        connect("postgresql://k2p_owner:Pa55 w0rd@127.0.0.1:9/kafka2pg")
    assert "it holds a space: in a URL, write a space in the password as %20" in str(failed.value)
    assert "w0rd" not in str(failed.value)


@pytest.mark.parametrize(
    ("url", "described"),
    [
        ("postgresql://postgres:postgres@localhost:5432/postgres", "localhost:5432/postgres"),
        ("postgresql://kafka2pg:kafka2pg@127.0.0.1:5432/kafka2pg", "127.0.0.1:5432/kafka2pg"),
        ("postgresql://db.example.com:6543/analytics?user=svc@srv", "db.example.com:6543/analytics"),
        ("postgresql://k:s3cret@db.example.com:5432/app?user=me@corp", "db.example.com:5432/app"),
    ],
)
def test_a_url_libpq_reads_as_written_is_described_as_it_is(url, described):
    assert describe(url) == described


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:pw@127.0.0.1:9/app%40prod",
        "postgresql:///app@prod?host=/nonexistent-socket-dir",
    ],
)
def test_an_at_sign_in_a_database_name_is_no_misread_password_and_a_failure_stays_retryable(url):
    """Only a password libpq read otherwise than typed makes the URL unusable (ConfigError); a
    database named with an '@' is described as it is, and a server down is still unavailable."""
    assert describe(url).endswith("/app@prod"), describe(url)
    with pytest.raises(DatabaseUnavailableError):
        connect(url, connect_timeout=2)


@pytest.mark.parametrize(
    ("tail", "refused"),
    [
        ("127.0.0.1:9/kafka2pg?sslmode=bogus", 'invalid sslmode value: "bogus"'),
        ("127.0.0.1:notaport/kafka2pg", 'invalid integer value "notaport" for connection option "port"'),
        ("127.0.0.1:99999/kafka2pg", 'invalid port number: "99999"'),
        (  # an @ after the authority is not a password's
            "127.0.0.1:notaport/kafka2pg?application_name=etl@host",
            'invalid integer value "notaport" for connection option "port"',
        ),
    ],
)
def test_an_option_libpq_refuses_is_a_configuration_error_not_an_unreachable_server(tail, refused):
    """No retry mends these, and the password (well written) is not what is wrong."""
    with pytest.raises(ConfigError) as failed:
        connect(f"postgresql://k2p_owner:S3cretPw@{tail}", connect_timeout=2)
    message = str(failed.value)
    assert f"has an option libpq refuses ({refused})" in message, message
    assert "S3cretPw" not in message and "password was read" not in message

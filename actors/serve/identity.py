"""Who a request is: the identity an API key grants, shared by the HTTP API and msgpack.

An API-key file (`cadence serve --api-keys FILE`) maps each key to a tenant and,
optionally, a priority ceiling and an in-flight limit, one key per line:

    # key                tenant   options
    sk-acme-9f3c...      acme     min_priority=2 max_inflight=16
    sk-beta-41aa...      beta

A request authenticated by a key is that key's tenant: the tenant it names may
only narrow it (`acme` itself or a sub-tenant `acme/...`), never name another,
so the prefix cache, which isolates tenants, isolates keys. `min_priority` is the
most urgent priority value (lower runs first) the key's requests get: a request
asking for a lower value is raised to it. `max_inflight` bounds the live
streams of all of the key's requests, over HTTP and msgpack together.

Keys are looked up by their SHA-256 digest, so the lookup takes the same time
whatever part of a wrong key matches a right one.
"""

from __future__ import annotations

import hashlib
import re
from typing import Mapping

import attrs

from cadence.statemachine.errors import ConfigError

from ..wire import MAX_ID, MAX_TENANT_CHARS

__all__ = ["KeyGrant", "ApiKeys", "IdentityError", "SUB_TENANT_SEPARATOR", "TOKEN68"]

# What an API key may be spelled with: RFC 6750's b64token, so that every key can be
# sent as `Authorization: Bearer KEY`.
TOKEN68 = r"[A-Za-z0-9\-._~+/]+=*"
_TOKEN68 = re.compile(TOKEN68)

# A key's tenant and a sub-tenant its requests name are joined by this.
SUB_TENANT_SEPARATOR = "/"
# The tenant a request names when it names none (the wire's and the HTTP API's default).
_UNNAMED_TENANT = "default"
_OPTIONS = ("min_priority", "max_inflight")


class IdentityError(Exception):
    """A request asks for more than its key allows; `field` names what it asked."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@attrs.frozen
class KeyGrant:
    """What one API key allows: its tenant, the most urgent priority value its
    requests get (None: any) and its live streams at once (None: no limit)."""

    tenant: str
    min_priority: int | None = None
    max_inflight: int | None = None

    def tenant_of(self, named: str | None) -> str:
        """The tenant of a request that names `named` (None or "default": none):
        this key's tenant, or a sub-tenant of it; IdentityError for any other."""
        if named is None or named == _UNNAMED_TENANT or named == self.tenant:
            return self.tenant
        if named.startswith(self.tenant + SUB_TENANT_SEPARATOR):
            return named
        raise IdentityError(
            f"tenant {named[:64]!r} is not this API key's tenant {self.tenant!r} or a sub-tenant "
            f"of it ({self.tenant}{SUB_TENANT_SEPARATOR}...)", "tenant")

    def priority_of(self, asked: int) -> int:
        """The priority a request asking for `asked` gets: at most as urgent as the ceiling."""
        if self.min_priority is None:
            return asked
        return max(asked, self.min_priority)


@attrs.frozen
class ApiKeys:
    """The grants of an API-key file, by the SHA-256 digest of each key."""

    _by_digest: Mapping[bytes, KeyGrant] = attrs.field(repr=False)

    @classmethod
    def from_grants(cls, grants: Mapping[str, KeyGrant]) -> ApiKeys:
        """From key -> grant (every key a TOKEN68: letters, digits, -._~+/ and trailing =)."""
        for key in grants:
            if _TOKEN68.fullmatch(key) is None:
                raise ConfigError("an API key must be letters, digits and -._~+/ (then any '='), "
                                  f"as a Bearer token is; got one of {len(key)} characters")
        if not grants:
            raise ConfigError("the API-key list is empty")
        return cls({_digest(key): grant for key, grant in grants.items()})

    @classmethod
    def parse(cls, text: str, source: str = "the API-key file") -> ApiKeys:
        """Parse the file format of the module docstring; ConfigError naming the line."""
        grants: dict[str, KeyGrant] = {}
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{source} line {number}"
            if len(words) < 2:
                raise ConfigError(f"{where}: expected 'KEY TENANT [min_priority=N] [max_inflight=N]'")
            key, tenant, *options = words
            if key in grants:
                raise ConfigError(f"{where}: this key is listed twice")
            grants[key] = _grant(tenant, options, where)
        if not grants:
            raise ConfigError(f"{source} lists no API key")
        return cls.from_grants(grants)

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """Read and parse an API-key file."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the API-key file: {exc.strerror}: {path}") from None
        return cls.parse(text, path)

    def grant_of(self, key: str | None) -> KeyGrant | None:
        """The grant of a presented key (None: no such key)."""
        if key is None:
            return None
        return self._by_digest.get(_digest(key))

    def __len__(self) -> int:
        return len(self._by_digest)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _grant(tenant: str, options: list[str], where: str) -> KeyGrant:
    if len(tenant) > MAX_TENANT_CHARS:
        raise ConfigError(f"{where}: the tenant has more than {MAX_TENANT_CHARS} characters")
    values: dict[str, int] = {}
    for option in options:
        name, equals, value = option.partition("=")
        if name not in _OPTIONS or not equals:
            raise ConfigError(f"{where}: unknown option {option!r}; expected one of "
                              + ", ".join(f"{o}=N" for o in _OPTIONS))
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{where}: {name} must be an integer, got {value!r}") from None
        if name == "max_inflight" and number < 1:
            raise ConfigError(f"{where}: max_inflight must be >= 1, got {number}")
        if abs(number) > MAX_ID:
            raise ConfigError(f"{where}: {name} must be within +-{MAX_ID}, got {number}")
        values[name] = number
    return KeyGrant(tenant, **values)

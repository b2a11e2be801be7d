"""distributed/init.py: a rendezvous host this machine cannot resolve is refused at once, in one
line naming MASTER_ADDR, before torch would retry it for the whole timeout."""

from __future__ import annotations

import pytest

from mscale.distributed.init import check_rendezvous_host
from mscale.errors import MscaleError


def test_an_address_or_a_resolvable_name_passes():
    check_rendezvous_host("127.0.0.1")
    check_rendezvous_host("localhost")


def test_a_name_that_does_not_resolve_names_master_addr_and_the_fix():
    with pytest.raises(MscaleError) as e:
        check_rendezvous_host("no-such-node.invalid")  # .invalid never resolves (RFC 2606)
    assert e.value.field == "MASTER_ADDR" and "'no-such-node.invalid' does not resolve" in str(e.value)
    assert "set MASTER_ADDR, inside the step" in e.value.fix


def test_a_malformed_host_is_refused_in_the_same_line():
    for bad in ("a" * 64, "node1..x"):  # UnicodeError inside getaddrinfo, not gaierror
        with pytest.raises(MscaleError, match="does not resolve"):
            check_rendezvous_host(bad)

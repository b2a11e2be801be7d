def test_usage_error_exits_3(cli):
    code, _, _ = cli("no-such-command")
    assert code == 3


def test_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("mscale ")

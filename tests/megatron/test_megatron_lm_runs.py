"""The e2e suite's run list (tests/support/megatron_lm_runs.py), on CPU: the DeepSeek-V3 routing runs carry
each of its flags once, on the Buffer's default SM budget split over every process the GPU holds,
and a selection keeps the runs each selected run is compared with."""

import megatron_lm_runs as mr


def _flag(argv, flag):
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times"
    i = argv.index(flag)
    return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None


def test_ds3_runs_route_as_deepseek_v3_on_the_default_sm_budget():
    runs = mr.ds3_runs()
    names = {r.name for r in runs}
    for shape in ("ep4", "ep4-2x2"):
        for variant, _ in mr.DS3_VARIANTS:
            assert f"main-ds3-{shape}-{variant}" in names
    pad = next(r for r in runs if r.name == "main-ds3-ep4-hybridep-pad")  # drop-and-pad, against alltoall's
    argv = mr.command(pad, "/lm", "/ckpt", sharers=12)[0]
    assert "--moe-pad-expert-input-to-capacity" in argv and _flag(argv, "--moe-expert-capacity-factor") == "1.0"
    assert mr.reference(pad.name) == "main-ds3-ep4-alltoall-pad"
    for run in runs:
        argv, env = mr.command(run, "/lm", "/ckpt", sharers=12)
        for flag, value in mr.DS3_ARGS.items():
            assert _flag(argv, flag) == value, (run.name, flag)
        assert "--moe-flex-dispatcher-num-sms" not in argv, run.name
        if run.dispatcher != "alltoall":
            assert env["MEGATRON_EP_DEVICE_SHARERS"] == "12" and _flag(argv, "--moe-flex-dispatcher-backend") == run.dispatcher
        assert ("MEGATRON_EP_RANKS_PER_NODE" in env) == ("-2x2-" in run.name), run.name
        assert mr.reference(run.name) in names | {None}
    # the other runs keep their fixed SM count
    other = next(r for r in mr.runs() if r.name == "main-ep4-deepep")
    assert _flag(mr.command(other, "/lm", "/ckpt")[0], "--moe-flex-dispatcher-num-sms") == str(mr.SMS_PER_RANK)


def test_selection_keeps_references_and_predecessors():
    got = [r.name for r in mr.select(mr.runs(), "main-ds3-ep4-2x2-hybridep-chunked, main-ep2-hybridep-grouped-resume")]
    assert set(got) == {"main-ds3-ep4-2x2-hybridep-chunked", "main-ds3-ep4-2x2-hybridep-grouped", mr.DS3_REF,
                        "main-ep2-hybridep-grouped-resume", "main-ep2-hybridep-grouped",
                        "main-ep2-hybridep-grouped-save", "main-ep2-hybridep", "main-ep2-alltoall"}
    assert len(mr.select(mr.runs(), None)) == len(mr.runs())

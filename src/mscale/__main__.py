"""``python -m mscale``: the ``mscale`` console script (cli/main.py), for an environment whose
scripts directory is not on PATH. ``mscale train`` records it as ``python -m mscale.cli.main``
(cli/train.py `launch_of`), which `mscale recover` runs again."""

from mscale.cli.main import main

if __name__ == "__main__":  # not in a worker re-running its launcher's __main__ as __mp_main__
    main()

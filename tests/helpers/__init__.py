"""What unit and e2e tests share: process launchers, tiny runs, models and files they build.
Imported as ``tests.helpers.<module>`` everywhere (also in the processes tests start, which
find ``tests`` from the repository root)."""

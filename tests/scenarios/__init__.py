"""Programs the tests run in processes of their own, each named `<what>_scenario.py`: the real
trainer with a fault or a probe added through its public extension points, run by path
(`harness.launching.SCENARIOS / name`) as a script or as a scenario of a shared world
(`path:function`, tests/harness/world_runner.py)."""

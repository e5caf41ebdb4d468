"""A plug-in module whose import fails: loading a topology that names it must say so, not crash."""

raise RuntimeError("this plug-in is broken on purpose")

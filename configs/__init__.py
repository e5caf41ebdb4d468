"""Bundled YAML topologies (default, redis, cluster, regional)."""

"""Simulated nodes on one machine: process-tree helpers now; the multi-node cluster builds on
them (see DESIGN.md, "Simulated cluster")."""

from aegis.sim.procs import descendants, kill_tree

__all__ = ["descendants", "kill_tree"]

"""Protocol core (no I/O): message rows, manifests, bundles and wire names — DESIGN.md section 3."""

"""The storage systems the benchmarks compare, behind one interface (``base.System``): FlatCake's
adapter and the baselines a user would otherwise pick. Each is built from its name through
``names.implementation`` (imported on use): importing this package loads none of them."""

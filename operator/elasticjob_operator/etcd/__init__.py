"""Everything the operator does with etcd: certificates, Secrets, the shared etcd's users,
the JSON gateway and the run records read through it."""

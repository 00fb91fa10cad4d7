"""What bounds a sandbox on its host: cgroups, disk quota, mount and network namespaces, uids."""

"""What every room shares: the errors bad input raises, checksums, the folder lock, fault
injection."""

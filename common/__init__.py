"""The lowest helpers, imported from every floor and importing no other batchrl folder: filesystem access for local
folders and s3:// prefixes, the storage root's layout, the package's own files."""

"""Operating the service: starting its parts and sizing them (see LAYOUT.md: ``ops``)."""

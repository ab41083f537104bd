"""Self-contained HTML reports with embedded matplotlib figures."""

"""What gateway, worker and services all speak: settings, protocol, Redis names, errors."""

--
-- idem_version(): the version of the loaded library, whose major.minor is
-- the extension version that CREATE EXTENSION installs with it
--
SELECT idempotency.idem_version();
SELECT idempotency.idem_version() = '1.6.2' AS is_1_6_2;
SELECT starts_with(idempotency.idem_version(), extversion || '.') AS starts_with_extversion
  FROM pg_extension WHERE extname = 'idempotency';

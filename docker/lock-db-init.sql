-- The lock database both deployments share, and a least-privilege role for it:
-- advisory locks need only CONNECT (see docs/howto-least-privilege.md).
CREATE ROLE pglock LOGIN PASSWORD 'pglock';
CREATE DATABASE locks OWNER postgres;
REVOKE ALL ON DATABASE locks FROM PUBLIC;
GRANT CONNECT ON DATABASE locks TO pglock;

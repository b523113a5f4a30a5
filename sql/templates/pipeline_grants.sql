-- One pipeline's tables for the runtime role, added to sql/grants.sql by `kafka2pg grant`; the
-- privileges are kafka2pg.migrations' TARGET_PRIVILEGES and STAGING_PRIVILEGES.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT {target_privileges} ON {target} TO {role};
GRANT {staging_privileges} ON {staging} TO {role};

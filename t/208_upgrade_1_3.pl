
# Copyright: the idempotency extension authors.
#
# 208_upgrade_1_3.pl: ALTER EXTENSION idempotency UPDATE to 1.3.
#
# What it proves:
#   - a 1.2 database with keys updates to 1.3 without touching a stored row
#     (same ctid and xmin, every column identical) or the token sequence,
#     and its keys work on (replay, finish with a 1.2 token);
#   - the stats view keeps its columns, in order, and gains
#     key_counts_exact; its key counts are the ones 1.2 showed; privileges
#     and options an administrator set on the view carry over (it is
#     replaced in place), a role kept from the view cannot read the counts
#     through stats_key_counts() either, and a user's view over it keeps
#     working;
#   - the updates from 1.2 and from 1.0 (one ALTER EXTENSION: 1.0 to 1.1 to
#     1.2 to 1.3) both give the catalog of a fresh 1.3 install.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55472 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('upgrade_1_3', port => 55472,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# "extension version|whether stats_key_counts() exists"
sub ext_state
{
	my ($db) = @_;
	return sql($db,
		    "SELECT concat_ws('|', extversion, "
		  . "to_regprocedure('idempotency.stats_key_counts()') IS NOT NULL) "
		  . "FROM pg_extension WHERE extname = 'idempotency'");
}

my $view_columns_sql =
    "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' "
  . "ORDER BY attnum) FROM pg_attribute "
  . "WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 0";
my $key_counts_sql =
    "SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
  . "WHERE database = current_database()";
my $view_acl_sql = "SELECT relacl FROM pg_class WHERE oid = 'idempotency.stats'::regclass";

# =========================================================================
# A 1.2 database with keys, an administrator's grants and a user's view
# =========================================================================
sql('postgres', 'CREATE DATABASE up');
sql('up', "CREATE EXTENSION idempotency VERSION '1.2'");
is(ext_state('up'), '1.2|f', 'up: 1.2 is installed, without stats_key_counts()');

my %token;
foreach my $key (qw(done failed live))
{
	my $c = claim($node, 'up', qq{'$key', request => '{"k": "$key"}', lease => '1 hour'});
	is($c->{outcome}, 'claimed', "up: $key is claimed under 1.2");
	$token{$key} = $c->{token};
}
sql('up', "SELECT idempotency.idem_finish('done', $token{done}, 201, '{\"id\": 1}')");
sql('up', "SELECT idempotency.idem_finish('failed', $token{failed}, 402, NULL, status => 'failed')");
my $done_md5 = body_md5($node, 'up', q{'{"id": 1}'});

sql('up', q{
CREATE ROLE regress_monitor;
GRANT USAGE ON SCHEMA idempotency TO regress_monitor;
CREATE ROLE regress_app;
GRANT USAGE ON SCHEMA idempotency TO regress_app;
REVOKE SELECT ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO regress_monitor;
ALTER VIEW idempotency.stats SET (security_barrier = true);
CREATE VIEW public.key_counts AS
	SELECT pending, succeeded, failed FROM idempotency.stats
	 WHERE database = current_database();
});
my $rows = key_rows($node, 'up');
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';
my $seq = sql('up', $seq_sql);
my $columns_1_2 = sql('up', $view_columns_sql);
my $view_acl = sql('up', $view_acl_sql);
is(sql('up', $key_counts_sql), '1,1,1', 'up: under 1.2 the view counts 1 pending, 1 succeeded, 1 failed');

# =========================================================================
# The update
# =========================================================================
is(sqlstate_of($node, 'up', "ALTER EXTENSION idempotency UPDATE TO '1.3'"), '00000',
	'up: ALTER EXTENSION idempotency UPDATE TO \'1.3\' succeeds');
is(ext_state('up'), '1.3|t', 'up: 1.3, with stats_key_counts()');
is(key_rows($node, 'up'), $rows,
	'up: every stored row is the same tuple (ctid, xmin), column for column');
is(sql('up', $seq_sql), $seq, 'up: the token sequence did not move');
is(sql('up', $view_columns_sql), "$columns_1_2, key_counts_exact boolean",
	'up: the stats view keeps its columns in order and gains key_counts_exact');
is(sql('up', $key_counts_sql), '1,1,1', 'up: the same key counts');
is( sql('up', 'SELECT key_counts_exact FROM idempotency.stats WHERE database = current_database()'),
	't', 'up: counted exactly (a small table)');
is(sql('up', $view_acl_sql), $view_acl, 'up: the view keeps the administrator\'s privileges');
is( sql('up',
		"SELECT has_table_privilege('public', 'idempotency.stats', 'SELECT')::text || ',' || "
		  . "has_table_privilege('regress_monitor', 'idempotency.stats', 'SELECT')::text"),
	'false,true', 'up: PUBLIC still may not read it, regress_monitor may');
is( sql('up', 'SET ROLE regress_monitor; SELECT concat_ws(\',\', pending, succeeded, failed) '
		  . 'FROM idempotency.stats WHERE database = current_database()'),
	'1,1,1', 'up: regress_monitor reads the counts without any privilege on the table');
is( sql('up', "SELECT array_to_string(reloptions, ',') FROM pg_class "
		  . "WHERE oid = 'idempotency.stats'::regclass"),
	'security_barrier=true', 'up: the view keeps the options the administrator set');
my ($state) = sql_result($node, 'up',
	'SET ROLE regress_app; SELECT * FROM idempotency.stats_key_counts()');
is($state, '42501',
	'up: a role the administrator kept from the view cannot read the counts through stats_key_counts() either');
is( sql('up', 'SET ROLE regress_monitor; SELECT concat_ws(\',\', pending, succeeded, failed) '
		  . 'FROM idempotency.stats_key_counts()'),
	'1,1,1', 'up: regress_monitor, who may read the view, may call it');
is(sql('up', 'SELECT concat_ws(\',\', pending, succeeded, failed) FROM public.key_counts'),
	'1,1,1', 'up: the user\'s view over stats keeps working');

is_deeply(claim($node, 'up', q{'done', request => '{"k": "done"}'}),
	replay_row('succeeded', 201, $done_md5), 'up: done replays its stored success');
is( sqlstate_of($node, 'up', "SELECT idempotency.idem_finish('live', $token{live}, 200)"),
	'00000', 'up: live is finished with its 1.2 token');
is(sql('up', $key_counts_sql), '0,2,1', 'up: the view counts the finish');

# =========================================================================
# Updated from 1.2 or from 1.0, the catalog is a fresh 1.3 install's
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', "CREATE EXTENSION idempotency VERSION '1.3'");
is(ext_state('fresh'), '1.3|t', 'fresh: 1.3 is installed');
sql('postgres', 'CREATE DATABASE from_1_2');
sql('from_1_2', "CREATE EXTENSION idempotency VERSION '1.2'");
is(sqlstate_of($node, 'from_1_2', "ALTER EXTENSION idempotency UPDATE TO '1.3'"), '00000',
	'from_1_2: updated to 1.3');
sql('postgres', 'CREATE DATABASE from_1_0');
sql('from_1_0', "CREATE EXTENSION idempotency VERSION '1.0'");
is(sqlstate_of($node, 'from_1_0', "ALTER EXTENSION idempotency UPDATE TO '1.3'"), '00000',
	'from_1_0: one ALTER EXTENSION updates 1.0 to 1.3');
is(ext_state('from_1_0'), '1.3|t', 'from_1_0: 1.3');

my %catalog = catalog_queries();
foreach my $what (sort keys %catalog)
{
	my $fresh = sql('fresh', $catalog{$what});
	isnt($fresh, '', "fresh: $what: the query finds something");
	is(sql('from_1_2', $catalog{$what}), $fresh, "1.2 updated = fresh: $what");
	is(sql('from_1_0', $catalog{$what}), $fresh, "1.0 updated = fresh: $what");
}
like(sql('fresh', $catalog{'functions (definition, owner, privileges)'}),
	qr/FUNCTION idempotency\.stats_key_counts\(OUT pending bigint, OUT succeeded bigint, OUT failed bigint, OUT exact boolean\)\n RETURNS record\n LANGUAGE c\n PARALLEL SAFE\n/,
	'fresh: stats_key_counts() is C, VOLATILE, PARALLEL SAFE, one record');
like(sql('fresh', $catalog{'extension members'}),
	qr/^function idempotency\.stats_key_counts\(\)$/m,
	'fresh: stats_key_counts() is a member of the extension');

$node->stop;
done_testing();

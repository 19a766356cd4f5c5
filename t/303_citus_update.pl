
# Copyright: the idempotency extension authors.
#
# 303_citus_update.pl: ALTER EXTENSION idempotency UPDATE from 1.6 (through
# 1.7) to the newest version on a Citus cluster whose keys are distributed, done as
# docs/scale-out.md says (on the coordinator first, then any node left
# behind, then distribute() once more on the coordinator).
#
# What it proves:
#   - every node ends at the newest version, and every shard of the keys
#     table gains the new columns and the index of reset keys, so the
#     library on each worker reads and writes them;
#   - the update itself goes through on the coordinator (it distributes
#     nothing while the workers lack the new functions), and distribute()
#     then makes the functions it created anew (idem_claim, idem_finish,
#     idem_finish_many, idem_lookup) and the new idem_forget and
#     idem_claim_abandoned distributed functions delegated by scope, as it
#     made the old ones;
#   - keys stored before the update answer as before (a finished key
#     replays, a pending key is finished with the token it got before);
#   - through the coordinator, a key claimed with remember and aged past
#     its retention answers expired, a different request mismatch, the
#     sweep compacts it in its shard, and idem_forget (delegated) lets it
#     run again;
#   - through the coordinator, a key claimed with keep_request whose lease
#     ended is reset by the sweep in its shard and taken over by
#     idem_claim_abandoned (delegated), which returns its request.
#
# It skips itself when Citus is not installed for the PostgreSQL under test.
# The nodes listen on 127.0.0.1, ports 31619 to 31621.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemCitus;
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $why = citus_available();
plan skip_all => $why if $why;

my $cluster     = citus_cluster(port => 31619, name => 'update');
my $coordinator = $cluster->{coordinator};
my @nodes       = @{ $cluster->{nodes} };

sub coord { return $coordinator->safe_psql('postgres', $_[0]); }

my $newest = coord(
	"SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'");

# Every node back to 1.6: the coordinator passes DROP and CREATE EXTENSION
# on to the workers, and a worker it did not reach gets them directly.
coord('DROP EXTENSION idempotency');
$_->safe_psql('postgres', 'DROP EXTENSION IF EXISTS idempotency') for @nodes;
coord("CREATE EXTENSION idempotency VERSION '1.6'");
for my $node (@nodes)
{
	$node->safe_psql('postgres', "CREATE EXTENSION idempotency VERSION '1.6'")
	  if $node->safe_psql('postgres',
		"SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'") eq '0';
}
is( join(',',
		map { $_->safe_psql('postgres',
				"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'") } @nodes),
	'1.6,1.6,1.6',
	'every node is at 1.6');

coord('SELECT idempotency.distribute()');
my $done = coord(
	    "SELECT token FROM idempotency.idem_claim('done', '{\"n\": 1}', scope => 'tenant-a', "
	  . "lease => '1 hour')");
coord("SELECT idempotency.idem_finish('done', $done, 201, '{\"id\": 1}', 'tenant-a')");
my $live = coord(
	    "SELECT token FROM idempotency.idem_claim('live', '{\"n\": 1}', scope => 'tenant-b', "
	  . "lease => '1 hour')");

# The update, as docs/scale-out.md says: the coordinator first, then any
# node left behind.
coord('ALTER EXTENSION idempotency UPDATE');
for my $node (@nodes)
{
	$node->safe_psql('postgres', 'ALTER EXTENSION idempotency UPDATE')
	  if $node->safe_psql('postgres',
		"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'") ne $newest;
}
is( join(',',
		map { $_->safe_psql('postgres',
				"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'") } @nodes),
	join(',', ($newest) x 3),
	"every node is at $newest");
# Then distribute() once more on the coordinator: it delegates the functions
# the update created anew.
coord('SELECT idempotency.distribute()');
is( coord(
		    "SELECT bool_and(r.success AND r.result = '0') FROM run_command_on_all_nodes("
		  . "\$\$SELECT count(*) FROM pg_class c WHERE c.relname ~ '^keys(_[0-9]+)?\$' "
		  . "AND c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'r' "
		  . "AND (SELECT count(*) FROM pg_attribute a WHERE a.attrelid = c.oid "
		  . "AND a.attname IN ('remember', 'request') AND NOT a.attisdropped) <> 2\$\$) r"),
	't', 'every copy and shard of the keys table on every node has the new columns');
is( coord(
		    "SELECT bool_and(r.success AND r.result = '0') FROM run_command_on_all_nodes("
		  . "\$\$SELECT count(*) FROM pg_class c WHERE c.relname ~ '^keys(_[0-9]+)?\$' "
		  . "AND c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'r' "
		  . "AND NOT EXISTS (SELECT FROM pg_index i JOIN pg_class x ON x.oid = i.indexrelid "
		  . "WHERE i.indrelid = c.oid AND x.relname ~ '^keys_abandoned_idx(_[0-9]+)?\$')\$\$) r"),
	't', 'every copy and shard of the keys table on every node has the index of reset keys');
is( coord(
		    "SELECT string_agg(p.proname || ':' || (o.distribution_argument_index IS NOT NULL) "
		  . "|| ':' || coalesce(o.force_delegation, false), ',' ORDER BY p.proname) "
		  . "FROM pg_dist_object o JOIN pg_proc p ON p.oid = o.objid "
		  . "WHERE o.classid = 'pg_proc'::regclass AND p.proname IN "
		  . "('idem_claim', 'idem_finish', 'idem_finish_many', 'idem_lookup', 'idem_forget', "
		  . "'idem_claim_abandoned')"),
	'idem_claim:true:true,idem_claim_abandoned:true:true,idem_finish:true:true,'
	  . 'idem_finish_many:true:true,idem_forget:true:true,idem_lookup:true:true',
	'the functions created anew, idem_forget and idem_claim_abandoned are delegated by scope');

# What was stored before answers as before.
# (each call on its own in its SELECT, so that Citus delegates it)
is( coord(
		    "SELECT outcome, response_code FROM idempotency.idem_claim("
		  . "'done', '{\"n\": 1}', scope => 'tenant-a')"),
	'replay|201', 'a key finished under 1.6 replays');
is( coord(
		"SELECT e IS NOT NULL FROM idempotency.idem_finish('live', $live, 200, NULL, 'tenant-b') e"),
	't', 'a key claimed under 1.6 is finished with its old token');

# Remembered keys, through the coordinator.
my $rem = coord(
	    "SELECT token FROM idempotency.idem_claim('rem', '{\"n\": 1}', scope => 'tenant-c', "
	  . "remember => '30 days')");
coord("SELECT idempotency.idem_finish('rem', $rem, 201, '{\"id\": 2}', 'tenant-c')");
coord(
	    "UPDATE idempotency.keys SET expires_at = now() - interval '1 second', "
	  . "sweep_at = now() - interval '1 second' WHERE scope = 'tenant-c' AND key = 'rem'");
is( coord(
		    "SELECT outcome, token, status, response_code, response_body "
		  . "FROM idempotency.idem_claim('rem', '{\"n\": 1}', scope => 'tenant-c')"),
	'expired||succeeded|201|', 'a remembered key answers expired');
is( coord(
		    "SELECT outcome FROM idempotency.idem_claim('rem', '{\"n\": 2}', "
		  . "scope => 'tenant-c')"),
	'mismatch', 'a different request: mismatch');
coord('SELECT * FROM idempotency.idem_sweep()');
is( coord(
		    "SELECT concat_ws(',', status, response_code, response_body IS NULL, "
		  . "sweep_at = expires_at + remember) FROM idempotency.keys "
		  . "WHERE scope = 'tenant-c' AND key = 'rem'"),
	'succeeded,201,t,t', 'the sweep compacted it in its shard');
my @lookup = split /\|/, coord("SELECT * FROM idempotency.idem_lookup('rem', 'tenant-c')"), -1;
is("$lookup[0],$lookup[3]," . ($lookup[8] ne '' ? 'until' : 'none'),
	'succeeded,,until', 'idem_lookup shows it without its body, with remembered_until');
is(coord("SELECT idempotency.idem_forget('rem', 'tenant-c')"),
	't', 'idem_forget removes it');
is( coord(
		    "SELECT outcome, attempt FROM idempotency.idem_claim('rem', "
		  . "'{\"n\": 2}', scope => 'tenant-c')"),
	'claimed|1', 'and it runs again');

# An abandoned key and a completer, through the coordinator.
my $job = coord(
	    "SELECT token FROM idempotency.idem_claim('job', '{\"n\": 3}', scope => 'tenant-d', "
	  . "keep_request => true)");
coord(
	    "UPDATE idempotency.keys SET lease_until = now() - interval '1 second', "
	  . "sweep_at = now() - interval '1 second' WHERE scope = 'tenant-d' AND key = 'job'");
coord('SELECT * FROM idempotency.idem_sweep()');
is( coord(
		    "SELECT token IS NULL, request FROM idempotency.keys "
		  . "WHERE scope = 'tenant-d' AND key = 'job'"),
	't|{"n": 3}', 'the sweep reset it in its shard and kept its request');
is( coord(
		    "SELECT key, attempt, token > $job, request "
		  . "FROM idempotency.idem_claim_abandoned('tenant-d', 10)"),
	'job|2|t|{"n": 3}', 'idem_claim_abandoned takes it over with its request');

$_->stop for @nodes;
done_testing();

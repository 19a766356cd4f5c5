
# Copyright: the idempotency extension authors.
#
# 300_citus_cluster.pl: the Citus cluster that the distributed tests build
# with t/lib/IdemCitus.pm works.
#
# What it proves:
#   - citus_cluster() starts a coordinator and two workers that each load
#     Citus and idempotency and have both extensions created, and the
#     coordinator sees both workers as active;
#   - the nodes reach each other over TCP: a table distributed by hash
#     through the coordinator gets citus.shard_count (32) shards, 1000 rows
#     inserted through the coordinator are all read back through it, and
#     each worker holds some of them in its own shard tables;
#   - shard_node_of() names the worker whose shard holds a given value.
#
# It skips itself when Citus is not installed for the PostgreSQL under test
# (scripts/build-citus.sh installs it for PostgreSQL 16 and later).  Run as
# described at the top of t/001_restart.pl; the nodes listen on 127.0.0.1,
# ports 31610 to 31612.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemCitus;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $why = citus_available();
plan skip_all => $why if $why;

my $cluster     = citus_cluster();
my $coordinator = $cluster->{coordinator};
my @workers     = @{ $cluster->{workers} };

sub coord { return $coordinator->safe_psql('postgres', $_[0]); }

is(coord('SELECT count(*) FROM citus_get_active_worker_nodes()'),
	'2', 'the coordinator has two active workers');
for my $node (@{ $cluster->{nodes} })
{
	is( $node->safe_psql('postgres',
			"SELECT string_agg(extname, ',' ORDER BY extname) FROM pg_extension "
			  . "WHERE extname IN ('citus', 'idempotency')"),
		'citus,idempotency',
		$node->name . ': both extensions are created');
	is($node->safe_psql('postgres', 'SHOW shared_preload_libraries'),
		'citus,idempotency', $node->name . ': Citus is preloaded first');
}

coord(
	    'CREATE TABLE public.items (id bigint PRIMARY KEY, payload text); '
	  . "SELECT create_distributed_table('public.items', 'id')");
is(coord("SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'public.items'::regclass"),
	'32', 'the distributed table has citus.shard_count shards');
coord("INSERT INTO public.items SELECT i, 'row ' || i FROM generate_series(1, 1000) AS i");
is(coord('SELECT count(*), sum(id) FROM public.items'),
	'1000|500500', 'the coordinator reads back the 1000 rows it inserted');

# The rows a node holds in its shard tables of public.items (items_<shardid>),
# which Citus lists in pg_class only with the override off.
sub local_rows
{
	my ($node) = @_;
	my @shards = split /\n/,
	  $node->safe_psql('postgres',
		    "SET citus.override_table_visibility = off;\n"
		  . "SELECT c.oid::regclass FROM pg_class c "
		  . "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' "
		  . "AND c.relname ~ '^items_[0-9]+\$'");
	return 0 unless @shards;
	return $node->safe_psql('postgres',
		'SELECT ' . join(' + ', map { "(SELECT count(*) FROM $_)" } @shards));
}

my $total = 0;
for my $w (@workers)
{
	my $n = local_rows($w);
	cmp_ok($n, '>', 0, $w->name . " holds some of the rows in its shards ($n)");
	$total += $n;
}
is($total, 1000, 'the workers hold the 1000 rows between them');
is(local_rows($coordinator), '0', 'the coordinator holds no shard of the rows');

my $holder = shard_node_of($cluster, 42, table => 'public.items');
my $shard = coord(
	"SELECT shard_name('public.items', get_shard_id_for_distribution_column('public.items', 42))");
for my $w (@workers)
{
	is($w->safe_psql('postgres', "SELECT to_regclass('$shard') IS NOT NULL"),
		$w == $holder ? 't' : 'f',
		$w->name . ($w == $holder ? ' has' : ' does not have')
		  . " the shard that shard_node_of() names for id 42");
}
is($holder->safe_psql('postgres', "SELECT payload FROM $shard WHERE id = 42"),
	'row 42', 'that shard holds the row with id 42');

citus_stop($cluster);
done_testing();
